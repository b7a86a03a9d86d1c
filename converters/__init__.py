"""nucleus-export's conversion library: archives and base models in, model files out.

No service code lives here. Entry point: :func:`convert`.
"""

from .api import convert
from .archive import ArchiveLimits
from .errors import ExportError, InputError, InternalError
from .formats.base import ConvertOptions
from .manifest import OutputManifest
from .progress import ProgressEvent

__all__ = ["convert", "ArchiveLimits", "ConvertOptions", "ExportError", "InputError", "InternalError", "OutputManifest", "ProgressEvent"]
