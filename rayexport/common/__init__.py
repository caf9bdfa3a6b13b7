"""What every layer uses: the one error type and its one-line message (`errors`), dtype names
(`dtypes`), the `--verify` levels and what each checks (`levels`), a process's memory
(`memory`), and bounded passes over tensor values (`scan`). Imports nothing else of rayexport."""
