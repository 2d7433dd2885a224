"""Mixture-of-experts pieces, one concept per module: ``routers`` (the rules that pick experts),
``block`` (the sparse block and ``routed_experts``), ``experts`` (family-specific expert math)."""
