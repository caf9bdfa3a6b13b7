"""Storage: one `store.Store` per fsspec URI prefix, whose writes commit only after their last
byte; the options it opens with (`settings`), reads made again when a body breaks off and
range-parallel downloads (`reads`), what S3 needs beyond fsspec (`s3`), and local paths on a
cluster whose nodes have disks of their own (`nodes`)."""
