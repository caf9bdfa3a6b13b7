"""The reload: transformers loads the export in a process of its own, within a memory bound.

`parent.check_reload` reads the export's safetensors headers by byte range and starts
`python -m rayexport.verification.reload.child DIR --tensors TABLE --mode MODE ...` with storage
credentials removed from its environment and an empty module cache, because remote code
executes on import. DIR holds the export's small files (the export itself when it is local);
weight bytes reach the child as it asks for them. The child runs one of three modes:

- `keys-only` (`child.compare_keys`): names and shapes against the model built on the meta device;
- `in-memory` (`child.reload_and_probe`): `from_pretrained` and a forward pass, for an export
  that fits the bound;
- `streamed` (`streamed.stream_and_probe`): the model built on the meta device, each module's
  tensors read just before its forward and dropped after it (accelerate's offload hooks), so
  memory stays at the largest module's tensors. It reads a local export's files itself; a
  remote export's bytes come from the parent over the child's stdin/stdout (`protocol`): the
  child writes `{"tensor": NAME}` lines, the parent answers each with `{"bytes": N}` (or
  `{"error": ...}`) and N bytes.

The child ends with `{"result": {...}}` on that same channel and loads the tokenizer too, when
the export carries one. What libraries print goes to its stderr.
"""
