"""What the tests share: tiny models (`models`), FSDP2 checkpoints of them written by real gloo
ranks (`checkpoints`), running the CLI and moving folders to and from S3 (`helpers`), a
fault-injecting S3 proxy (`fault_proxy`) and rank-file metadata for planning (`plan_cases`).

The benchmarks import the same modules, with this folder's parent (tests/) on sys.path."""
