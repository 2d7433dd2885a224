"""The `lean-qwenflash` command (also `python -m lean_qwenflash`)."""
from __future__ import annotations

import argparse
import sys

from .common import KV_CACHE_DTYPES
from .config import format_size
from .doctor import sizes_line
from .quant.presets import PRESETS as QUANT_PRESETS


def _quant_preset(value: str) -> str:
    """--quant's check: one of the presets, or an error saying why not (the I-quant lattice types)."""
    from .quant.presets import check_preset
    try:
        return check_preset(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_pack(args) -> int:
    from .store.packer import pack
    m = pack(args.hf_dir, args.out_dir, dtype=args.dtype, force=args.force, progress=not args.quiet,
             quant=args.quant, tokenizer_dir=args.tokenizer)
    print(f"packed {m.architecture} into {args.out_dir}: {len(m.layers)} MoE layers, {m.num_records} expert "
          f"records, {format_size(m.experts_bytes)} of experts; tokenizer files: {', '.join(m.tokenizer_files) or 'none'}")
    print(encoding_summary(m))
    for note in m.notes:
        print(f"note: {note}")
    return 0


def encoding_summary(m) -> str:
    """One line per tensor group (expert projections, then resident groups): encodings and bytes."""
    lines = [f"  experts.{name:8s} {sizes_line(per)}" for name, per in m.encodings().items()]
    lines += [f"  {name} {sizes_line(per)}" for name, per in m.resident_groups().items()]
    return "encodings:\n" + "\n".join(lines) if lines else "encodings: (no routed experts)"


def tensor_table(m) -> str:
    """Every tensor of a pack with its shape, encoding and bytes: the routed-expert projections of
    each MoE layer (bytes per record, and for all of the layer's experts), then every resident tensor."""
    lines = ["tensors:"]
    for l in m.layers:
        for t in l.tensors:
            lines.append(f"  layers.{l.layer_idx}.experts.{t.name:8s} {str(list(t.shape)):14s} {t.encoding:7s} "
                         f"{format_size(t.nbytes)} x {l.num_experts} = {format_size(t.nbytes * l.num_experts)}")
    for t in m.resident:
        enc = t.encoding if not t.parts else "mixed(" + ", ".join(f"{e} x {r} rows" for e, r in t.parts) + ")"
        lines.append(f"  {t.name} {list(t.shape)} {enc} {format_size(t.nbytes)}")
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    from .store import ExpertStore
    with ExpertStore.open(args.pack, engine=args.io_engine, verify_checksums=not args.no_verify) as store:
        m = store.manifest
        print(f"pack:         {store.path}")
        print(f"architecture: {m.architecture} ({m.family}), {m.created_by}")
        print(f"experts:      {m.num_records} records in {len(m.layers)} layers, {format_size(m.experts_bytes)}")
        if m.layers:
            l0 = m.layers[0]
            shapes = ", ".join(f"{t.name} {list(t.shape)} {t.encoding}" for t in l0.tensors)
            print(f"record:       {format_size(l0.record_bytes)} ({shapes})"
                  + (" (layers differ; see encodings)" if len({l.tensors for l in m.layers}) > 1 else ""))
        if m.resident:
            print("resident:     " + sizes_line(m.resident_encodings()))
        print(encoding_summary(m))
        print(tensor_table(m))
        for note in m.notes:
            print(f"note:         {note}")
        print(f"I/O engine:   {store.engine.kind if store.engine else '-'}"
              f"{' (' + store.engine.fallback_reason.strip() + ')' if store.engine and store.engine.fallback_reason else ''}")
        if args.verify_all:
            import time
            t0 = time.perf_counter()
            for rec in m.layers:
                store.read_layer(rec.layer_idx)   # read (checked unless --no-verify), not kept
            dt = time.perf_counter() - t0
            print(f"verified:     all {m.num_records} records match their checksums "
                  f"({format_size(int(m.experts_bytes / max(dt, 1e-9)))}/s)")
    return 0


def _runtime_config(args):
    from .config import load_config
    overrides = {"model": getattr(args, "model", None)}
    for key in ("io_engine", "host_cache_bytes", "kv_cache_dtype"):
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    if getattr(args, "no_prefetch", False):
        overrides["prefetch"] = False
    return load_config(args.config, **overrides)


def _prompt_ids(args, rt) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be integers separated by commas, got {args.prompt_ids!r}") from None
        vocab = int(rt.store.config["vocab_size"])
        bad = [i for i in ids if not 0 <= i < vocab]
        if not ids or bad:
            raise ValueError(f"--prompt-ids must be non-empty token ids in 0..{vocab - 1}" + (f"; got {bad[:5]}" if bad else ""))
        return ids
    if rt.tokenizer is None:
        raise ValueError(f"the pack {rt.store.path} has no tokenizer.json; give --prompt-ids instead of --prompt")
    if args.raw or rt.tokenizer.chat_template is None:
        return rt.tokenizer.encode(args.prompt)
    return rt.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            enable_thinking=args.think, tokenize=True)


def cmd_generate(args) -> int:
    import time
    from .generate.generator import Generator
    from .runtime import Runtime, sampling_params

    cfg = _runtime_config(args)
    gen_cfg = cfg.generation
    params = sampling_params(gen_cfg, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    max_tokens = args.max_tokens or gen_cfg.max_tokens
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    choices = None
    if args.choices is not None:
        choices = args.choices.split("|")
        if not all(choices):
            raise ValueError(f"--choices must be non-empty continuations separated by '|', got {args.choices!r}")
    from .experts.trace import recording
    with Runtime.open(cfg) as rt, recording(rt.provider, getattr(args, "trace", None), _stderr_line):
        prompt = _prompt_ids(args, rt)
        if choices is not None:
            return _rank_choices(args, rt, cfg, prompt, choices)
        tok = rt.tokenizer
        stop = set(tok.eos_token_ids) if tok else set()
        decoder = tok.incremental_decoder(skip_special_tokens=not args.show_special) if tok else None
        t0 = time.perf_counter()
        first = None
        n = 0
        try:
            for token in Generator(rt.model, rt.prefill_chunk_tokens).generate(
                    prompt, params, max_tokens, stop_token_ids=stop):
                if first is None:
                    first = time.perf_counter()
                n += 1
                piece = decoder.push(token) if decoder else f"{token} "
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write("\n[stopped]")
        if decoder:
            sys.stdout.write(decoder.finish())
        sys.stdout.write("\n")
        sys.stdout.flush()
        end = time.perf_counter()
        if not args.no_stats:
            prefill_s = (first or end) - t0
            decode_s = end - (first or end)
            if hasattr(rt.provider, "stats"):
                rt.provider.stats.tokens = len(prompt) + n
            print(f"\n{len(prompt)} prompt tokens in {prefill_s:.2f} s, {n} generated"
                  + (f" at {(n - 1) / decode_s:.2f} tokens/s" if n > 1 and decode_s > 0 else ""), file=sys.stderr)
            if hasattr(rt.provider, "describe"):
                print(rt.provider.describe(), file=sys.stderr)
            print(rt.stats_table(per_layer=args.per_layer), file=sys.stderr)
    return 0


def _rank_choices(args, rt, cfg, prompt: list[int], choices: list[str]) -> int:
    """generate --choices: each continuation's log-likelihood after the prompt (one prefill), best
    first; a choice is tokenized as it reads after the prompt's text."""
    import time
    from .generate.generator import Generator, continuation_ids
    tok = rt.tokenizer
    if tok is None:
        raise ValueError(f"the pack {rt.store.path} has no tokenizer.json: --choices needs one to tokenize the choices")
    text = None
    if args.prompt is not None:
        text = args.prompt if args.raw or tok.chat_template is None else tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], enable_thinking=args.think)
    conts = [continuation_ids(tok.encode, prompt, text, c) for c in choices]
    t0 = time.perf_counter()
    scores = Generator(rt.model, rt.prefill_chunk_tokens).score(prompt, conts)
    seconds = time.perf_counter() - t0
    print(f"{'rank':>4}  {'total':>9}  {'mean':>9}  {'tokens':>6}  choice")
    for rank, s in enumerate(sorted(scores, key=lambda s: s.total, reverse=True), 1):
        print(f"{rank:>4}  {s.total:>9.4f}  {s.mean:>9.4f}  {len(s.tokens):>6}  {choices[s.index]}")
    if not args.no_stats:
        print(f"\n{len(prompt)} prompt tokens prefilled once, {len(choices)} choices "
              f"({sum(len(c) for c in conts)} tokens) scored in {seconds:.2f} s", file=sys.stderr)
    return 0


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr)


def cmd_replay(args) -> int:
    from .common import parse_size
    from .experts.trace import POLICIES, TraceError, read_trace, replay_table
    trace = read_trace(args.file)
    sizes = [parse_size(s.strip(), "--cache") for s in args.cache.split(",") if s.strip()]
    policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise TraceError(f"--policy: {', '.join(bad) or '(none)'} not among {', '.join(POLICIES)}")
    gbps, how = args.disk_gbps, "--disk-gbps"
    if gbps is None and args.model:
        from .doctor import measure_disk_gbps
        gbps, how = measure_disk_gbps(args.model, args.probe_seconds), f"the doctor's read probe of {args.model}"
    h = trace.header
    print(f"trace: {args.file}: {len(trace.records)} acquires, {len(trace.steps())} forward passes "
          f"({len(trace.decode_steps())} decode tokens), {len(h['layers'])} MoE layers, top-{h['top_k']} "
          f"of {h['num_experts']}, records of {format_size(h['slot_bytes'])}"
          + (" (the last record was cut short and is left out)" if trace.truncated else ""))
    print(f"disk: {gbps:.2f} GB/s ({how})" if gbps else
          "disk: not given (--disk-gbps N, or --model PACK to measure its drive): no speed column")
    print(replay_table(trace, sizes, policies, gbps))
    print("read/token: bytes read from the store per decode token; tok/s (I/O): disk speed / read per token "
          "(the bound from I/O alone). opt = Belady, the best any cache could do.")
    return 0


def cmd_chat(args) -> int:
    from .repl import chat_loop
    from .runtime import Runtime, sampling_params

    cfg = _runtime_config(args)
    g = cfg.generation
    params = sampling_params(g, temperature=args.temperature, seed=args.seed)
    with Runtime.open(cfg) as rt:
        return chat_loop(rt, params, args.max_tokens or g.max_tokens, think=args.think, system=args.system)


def cmd_doctor(args) -> int:
    from .doctor import run_doctor
    model = args.model
    cfg = _runtime_config(args) if args.config else None
    if model is None and cfg is not None:
        model = cfg.model
    return run_doctor(model, probe_seconds=args.probe_seconds, cfg=cfg, trace=args.trace)


def cmd_stats(args) -> int:
    import urllib.error
    import urllib.request
    url = args.url.rstrip("/") + "/metrics"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot read {url}: {e} (is `lean-qwenflash serve` running there?)") from None
    rows = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip() or line.startswith(("python_", "process_")):
            continue
        name, _, value = line.rpartition(" ")
        if name.endswith(("_created", "_bucket")):
            continue
        rows.append((name, value))
    width = max((len(n) for n, _ in rows), default=0)
    for name, value in rows:
        try:
            v = float(value)
            value = f"{v:,.0f}" if v.is_integer() else f"{v:,.4f}"
        except ValueError:
            pass
        print(f"{name.ljust(width)}  {value}")
    return 0


def cmd_serve(args) -> int:
    from .server.main import run
    return run(args)


def cmd_pull(args) -> int:
    from .hub import next_steps, pull
    r = pull(args.ref, out_dir=args.out, quant=args.quant, revision=args.revision, force=args.force,
             progress=not args.quiet)
    print(f"pack: {r.pack_dir}")
    print("next:")
    for line in next_steps(r.pack_dir):
        print(f"  {line}")
    return 0


def _add_runtime_args(p) -> None:
    p.add_argument("--config", help="runtime config YAML (see configs/); default: built-in defaults")
    p.add_argument("--model", help="pack directory (overrides the config's model; default: the built-in model)")
    p.add_argument("--io-engine", choices=["auto", "uring", "pread"], help="override io_engine")
    p.add_argument("--host-cache-bytes", help="override host_cache_bytes, e.g. 2GiB")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="override kv_cache_dtype (f32, f16, bf16, "
                   "q8_0, q4_0): how attention stores keys and values")
    p.add_argument("--no-prefetch", action="store_true", help="turn layer-ahead prefetch off")


def _hf_architectures() -> list[str]:
    from .families import supported_architectures
    return supported_architectures()


def _gguf_architectures() -> list[str]:
    """The registry's GGUF architecture names, each with its family where the name does not say it
    (e.g. "llama (mixtral)")."""
    from .families import gguf_architectures
    return [g if g == family.replace("_", "") else f"{g} ({family})" for g, family in gguf_architectures().items()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lean-qwenflash",
        description="Run Mixture-of-Experts language models larger than memory: routed experts stream "
                    "from a packed store on NVMe through RAM (and VRAM) caches.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    pk = sub.add_parser("pack", help="convert a Hugging Face checkpoint or a GGUF file into a pack",
                        description="Convert a Hugging Face checkpoint (config.json + *.safetensors; bf16/fp16/fp32) "
                                    "or a GGUF file (llama.cpp's format: one file, the first shard of a "
                                    "-00001-of-0000N.gguf split, or a directory of shards) into a pack directory: "
                                    "manifest.json, resident.safetensors (everything but routed experts), experts.bin "
                                    "(one 4096-aligned record per layer and expert) and experts.idx (checksums). "
                                    "A GGUF file's experts and quantized matrices are copied byte for byte; its "
                                    "tokenizer and chat template come from its metadata. Streams one tensor at a "
                                    "time, so checkpoints larger than RAM pack fine; the output appears only when "
                                    "complete. Hugging Face architectures: " + ", ".join(_hf_architectures()) +
                                    ". GGUF architectures: " + ", ".join(_gguf_architectures()) + ".")
    pk.add_argument("hf_dir", metavar="SOURCE",
                    help="checkpoint directory (e.g. one downloaded with `huggingface-cli download`) or GGUF file")
    pk.add_argument("out_dir", help="pack directory to create (must not exist unless --force)")
    pk.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="convert routed experts to this dtype (default: keep the checkpoint's)")
    pk.add_argument("--quant", type=_quant_preset, metavar="PRESET",
                    help="encode routed experts in GGUF block formats: q4_k_m (q4_k, down q6_k in some layers; "
                         "about 3.5x fewer bytes than bf16), q5_k_m, q3_k_m, q2_k, q4_k, q5_k, q6_k, q8_0, q4_0, "
                         "q4_1, q5_0, q5_1, iq4_nl, iq4_xs, mxfp4, or a float (bf16, f16, f32). The block presets "
                         "also encode attention, shared-expert and head matrices; embeddings, norms and routers stay "
                         "float. Rows a block format cannot hold take the nearest 32-value type (q4_k -> q5_0, "
                         "q6_k -> q8_0, ...), else bf16 (the summary says which). The I-quant lattice types "
                         "(iq1/iq2/iq3) need an importance matrix: pack a GGUF file llama.cpp made instead. On a "
                         "GGUF source this re-encodes from the dequantized weights instead of copying the file's blocks.")
    pk.add_argument("--tokenizer", metavar="HF_DIR",
                    help="take tokenizer.json, tokenizer_config.json (chat template) etc. from this Hugging Face "
                         "model directory (for GGUF files whose tokenizer cannot be converted, e.g. SentencePiece)")
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

    gen = sub.add_parser("generate", help="generate text for one prompt (streamed), then print tier statistics",
                         description="Generate a continuation of one prompt, streaming it to stdout; statistics "
                                     "(tokens/s, expert cache hits, bytes read, stalls) go to stderr. With a "
                                     "chat model the prompt is sent as a user message through the chat template "
                                     "(--raw sends it as is). With --choices it generates nothing: it ranks the "
                                     "given continuations by log-likelihood after the prompt.")
    gen.add_argument("--prompt", help="prompt text")
    gen.add_argument("--prompt-ids", help="prompt as token ids, e.g. 1,2,3 (for packs without a tokenizer)")
    gen.add_argument("--max-tokens", type=int, help="most tokens to generate (default: config generation.max_tokens)")
    gen.add_argument("--temperature", type=float, help="0 = greedy (default: config)")
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int, help="seed for sampling")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--think", action="store_true", help="let the model think (<think> block) before answering")
    gen.add_argument("--show-special", action="store_true", help="print special tokens")
    gen.add_argument("--per-layer", action="store_true", help="per-layer statistics")
    gen.add_argument("--no-stats", action="store_true", help="do not print statistics")
    gen.add_argument("--trace", metavar="FILE", help="append the routed expert ids of every layer and token to "
                     "FILE (a routing trace for `replay` and `doctor --trace`)")
    gen.add_argument("--choices", metavar="'A|B|C'",
                     help="rank these continuations of the prompt (separated by |) by total and mean log-likelihood, "
                          "from one prefill of the prompt, instead of generating")
    _add_runtime_args(gen)
    gen.set_defaults(func=cmd_generate)

    for name in ("chat", "run"):
        ch = sub.add_parser(name, help="interactive chat in the terminal (default model when none is given)"
                            if name == "chat" else "same as chat",
                            description="Chat with a model in the terminal; answers stream as they are generated. "
                                        "Commands: /stats shows expert tier statistics, /reset starts over, "
                                        "/think on|off, /quit. Ctrl-C stops an answer; Ctrl-C or Ctrl-D at the "
                                        "prompt leaves.")
        ch.add_argument("--max-tokens", type=int, help="most tokens per answer (default: config)")
        ch.add_argument("--temperature", type=float, help="0 = greedy (default: config)")
        ch.add_argument("--seed", type=int)
        ch.add_argument("--think", action="store_true", help="start with thinking on")
        ch.add_argument("--system", help="system prompt")
        _add_runtime_args(ch)
        ch.set_defaults(func=cmd_chat)

    doc = sub.add_parser("doctor", help="check this machine (io_uring, O_DIRECT, RAM/VRAM, CUDA, disk speed)",
                         description="Check what this machine offers for streaming: io_uring (or why not), O_DIRECT "
                                     "on the pack's filesystem, free RAM and VRAM, CUDA and kernel packages, a short "
                                     "read-bandwidth probe of the pack's drive; with --model, suggested cache sizes.")
    doc.add_argument("--model", help="pack directory to probe and size caches for")
    doc.add_argument("--config", help="take the pack from this config")
    doc.add_argument("--probe-seconds", type=float, default=2.0)
    doc.add_argument("--trace", metavar="FILE",
                     help="a routing trace (generate/serve --trace): suggest host_cache_bytes from it")
    doc.set_defaults(func=cmd_doctor)

    pl = sub.add_parser("pull", help="download a model from the Hugging Face Hub and pack it",
                        description="Download REPO (a GGUF repository: the file of the quant asked for, every shard "
                                    "of a split; or a Hugging Face checkpoint: its safetensors, config and tokenizer) "
                                    "through huggingface_hub (resumable, its cache; HF_TOKEN, HF_ENDPOINT, HF_HOME and "
                                    "HF_HUB_OFFLINE are honoured), then pack it and print the commands to run it. Free "
                                    "space is checked against the listing's sizes before anything is downloaded.")
    pl.add_argument("ref", metavar="REPO[:QUANT_OR_FILE]",
                    help="e.g. Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M (quant label, case-insensitive), "
                         "OWNER/NAME:FILE.gguf, or OWNER/NAME (a checkpoint; or a GGUF repo's Q4_K_M / only quant)")
    pl.add_argument("--quant", type=_quant_preset, metavar="PRESET",
                    help="encode a Hugging Face checkpoint while packing (as `pack --quant`), e.g. q4_k_m")
    pl.add_argument("--out", help="pack directory (default ~/.cache/lean-qwenflash/packs/OWNER--NAME--QUANT)")
    pl.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    pl.add_argument("--force", action="store_true", help="pack again even if the pack exists")
    pl.add_argument("--quiet", action="store_true", help="no progress bars")
    pl.set_defaults(func=cmd_pull)

    rp = sub.add_parser("replay", help="replay a routing trace against cache sizes and policies",
                        description="Run a routing trace (recorded with `generate --trace FILE` or `serve --trace "
                                    "FILE`) through simulated host caches: per size and policy the hit rate, bytes "
                                    "read per decode token and the decode speed the disk allows. lfu and lru are the "
                                    "runtime's own policies (cache_policy; lfu the default): at the run's "
                                    "host_cache_bytes and cache_policy (prefetch off) the replay gives exactly the "
                                    "hits the run counted; opt (Belady) is the best any cache could do.")
    rp.add_argument("file", metavar="FILE", help="trace file")
    rp.add_argument("--cache", default="1GiB,2GiB,4GiB,8GiB", help="host cache sizes, comma-separated")
    rp.add_argument("--policy", default="lru,lfu", help="policies, comma-separated: lru, lfu, opt")
    rp.add_argument("--disk-gbps", type=float, help="disk read speed in GB/s (default: measure --model's drive)")
    rp.add_argument("--model", help="pack whose drive the doctor's read probe measures")
    rp.add_argument("--probe-seconds", type=float, default=2.0)
    rp.set_defaults(func=cmd_replay)

    stt = sub.add_parser("stats", help="read statistics from a running server",
                         description="Fetch /metrics from a running `lean-qwenflash serve` and print it readably.")
    stt.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    stt.add_argument("--api-key", help="the server's API key, if it has one")
    stt.set_defaults(func=cmd_stats)

    from .server.main import add_arguments as add_serve_arguments
    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                         description="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                     "/v1/models, /health, /metrics); loopback only unless server.api_key is set. "
                                     "Same as `python -m lean_qwenflash.server`.")
    add_serve_arguments(srv)
    srv.set_defaults(func=cmd_serve)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and (args.prompt is None) == (args.prompt_ids is None):
        parser.error("generate needs exactly one of --prompt or --prompt-ids")
    from .io_engine import IoError
    try:
        return args.func(args)
    # ValueError covers our own errors too: StoreError, CheckpointError, UnsupportedArchitecture and
    # ConfigError all subclass it.
    except (FileExistsError, IoError, ValueError) as e:
        print(f"lean-qwenflash {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
