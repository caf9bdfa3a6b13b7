"""The export on Ray: its options (`options`), the driver's first step (`export_plan`), where
workers run (`placement`, `nodes`), the worker actor (`workers`) and its spool folders
(`spool`), the group of workers and each step's fail-fast wait (`group`, `waits`), warm pools
(`pool`), joining or starting Ray (`session`), and the export's steps and their report (`job`,
`report`). Ray and torch.distributed are used here and in `transport.gather` only."""
