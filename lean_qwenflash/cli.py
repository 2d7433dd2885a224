"""The `lean-qwenflash` command (also `python -m lean_qwenflash`)."""
from __future__ import annotations

import argparse
import sys


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_pack(args) -> int:
    from .store.packer import pack
    m = pack(args.hf_dir, args.out_dir, dtype=args.dtype, force=args.force, progress=not args.quiet)
    print(f"packed {m.architecture} into {args.out_dir}: {len(m.layers)} MoE layers, {m.num_records} expert "
          f"records, {_human_bytes(m.experts_bytes)} of experts; tokenizer files: {', '.join(m.tokenizer_files) or 'none'}")
    return 0


def cmd_inspect(args) -> int:
    from .store import ExpertStore
    with ExpertStore.open(args.pack, engine=args.io_engine, verify_checksums=not args.no_verify) as store:
        m = store.manifest
        print(f"pack:         {store.path}")
        print(f"architecture: {m.architecture} ({m.family}), {m.created_by}")
        print(f"experts:      {m.num_records} records in {len(m.layers)} layers, {_human_bytes(m.experts_bytes)}")
        if m.layers:
            l0 = m.layers[0]
            shapes = ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in l0.tensors)
            print(f"record:       {_human_bytes(l0.record_bytes)} ({shapes})")
        print(f"I/O engine:   {store.engine.kind if store.engine else '-'}"
              f"{' (' + store.engine.fallback_reason.strip() + ')' if store.engine and store.engine.fallback_reason else ''}")
        if args.verify_all:
            from .io_engine import AlignedBuffer
            import time
            t0 = time.perf_counter()
            for rec in m.layers:
                buf = AlignedBuffer(rec.record_bytes * rec.num_experts)
                store.read([(rec.layer_idx, e, buf, e * rec.record_bytes) for e in range(rec.num_experts)])
            dt = time.perf_counter() - t0
            print(f"verified:     all {m.num_records} records match their checksums "
                  f"({_human_bytes(m.experts_bytes / max(dt, 1e-9))}/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lean-qwenflash",
        description="Run Mixture-of-Experts language models larger than memory: routed experts stream "
                    "from a packed store on NVMe through RAM (and VRAM) caches.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    pk = sub.add_parser("pack", help="convert a Hugging Face checkpoint directory into a pack",
                        description="Convert a Hugging Face checkpoint (config.json + *.safetensors; bf16/fp16/fp32) "
                                    "into a pack directory: manifest.json, resident.safetensors (everything but "
                                    "routed experts), experts.bin (one 4096-aligned record per layer and expert) and "
                                    "experts.idx (checksums). Streams one tensor at a time, so checkpoints larger "
                                    "than RAM pack fine; the output appears only when complete.")
    pk.add_argument("hf_dir", help="checkpoint directory (e.g. one downloaded with `huggingface-cli download`)")
    pk.add_argument("out_dir", help="pack directory to create (must not exist unless --force)")
    pk.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="convert routed experts to this dtype (default: keep the checkpoint's)")
    pk.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    pk.add_argument("--quiet", action="store_true", help="no progress bar")
    pk.set_defaults(func=cmd_pack)

    ins = sub.add_parser("inspect", help="validate a pack and describe it",
                         description="Open a pack (checks format, version, sizes and the record table) and print "
                                     "what it holds; --verify-all reads every record and checks its checksum.")
    ins.add_argument("pack", help="pack directory")
    ins.add_argument("--io-engine", default="auto", choices=["auto", "uring", "pread"])
    ins.add_argument("--verify-all", action="store_true", help="read every record and check its CRC-32C")
    ins.add_argument("--no-verify", action="store_true", help="skip checksum verification")
    ins.set_defaults(func=cmd_inspect)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .store.format import StoreError
    from .store.checkpoint import CheckpointError
    from .store.naming import UnsupportedArchitecture
    from .io_engine import IoError
    try:
        return args.func(args)
    except (StoreError, CheckpointError, UnsupportedArchitecture, FileExistsError, IoError, ValueError) as e:
        print(f"lean-qwenflash {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
