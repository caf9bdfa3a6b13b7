"""rayexport: sharded FSDP training checkpoints to Hugging Face models, with Ray."""

from rayexport.errors import ExportError
from rayexport.job import ExportReport, export
from rayexport.options import ExportOptions

__all__ = ["ExportError", "ExportOptions", "ExportReport", "export"]
