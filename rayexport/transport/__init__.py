"""From the workers' pieces to files on storage: pieces cut and assembled (`assembly`), the
windowed gather to each bucket's writer over gloo or NCCL (`gather`), streamed safetensors
shards and their index (`writer`), and the commit object written last (`manifest`)."""
