"""minifsdp: a readable re-implementation of sharded data-parallel training.

Layers (a module imports only from layers above it): runtime (``dist``,
``launch``) -> recording (``trace``, ``memory``) -> communication (``comm``)
-> leaves (``models``, ``data``, ``estimate``) -> techniques (``ddp``,
``zero``, ``fsdp``, ...) -> front (``train``, ``demo``, ``bench``, ``plot``).
See DESIGN.md in the lab's shared folder and README.md.
"""

from .launch import LaunchError, LaunchTimeout, WorkerError, launch

__all__ = ["launch", "LaunchError", "WorkerError", "LaunchTimeout"]
__version__ = "0.1.0"
