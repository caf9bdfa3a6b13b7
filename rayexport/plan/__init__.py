"""Planning, pure functions over what the readers report (no I/O, no Ray, no process groups):
what a reader reports of a tensor (`shards`), where each slice lives (`pieces`), wrapper
prefixes stripped (`keys`), tied aliases (`ties`: BRIEF 1.1 and 1.3 are fixed there), LoRA
(`lora`), the formats and namings of a model (`formats`, `tiles`, `torchtitan`), which output
tensor each source key becomes (`naming`), and output files, rank-to-worker assignment and
gather buckets (`schedule`).
"""
