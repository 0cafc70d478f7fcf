"""Test and demo fixtures: random checkpoints in the released layout, the test tokenizer, the vLLM server
launcher. Shipped for tests, benchmarks and the demo; product code never imports them."""
