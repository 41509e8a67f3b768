"""Expert-parallel MoE (Speculative MoE, arXiv 2503.04398): routing statistics, expert placement applied to weights."""
