"""Planning, in three pure steps over what the readers report (no I/O, no Ray, no process
groups): `pieces` (where each slice of a tensor lives), `naming` (which output tensor each
source key becomes, ties, LoRA, dtypes), `schedule` (output files, rank-to-worker assignment,
gather buckets).
"""
