"""rayexport: sharded FSDP training checkpoints to Hugging Face models, with Ray."""

from rayexport.errors import ExportError
from rayexport.job import export
from rayexport.report import ExportReport
from rayexport.options import ExportOptions
from rayexport.pool import close_pool
from rayexport.remote import ExportFailed, export_remote

__all__ = ["ExportError", "ExportFailed", "ExportOptions", "ExportReport", "close_pool", "export", "export_remote"]
