"""A notebook kernel reached through Unix sockets rather than TCP ports.

jupyter_client picks a kernel's five TCP ports by binding port 0 and closing it, then the kernel
binds them: in between, any other process on the machine (a rank's gloo connection, another test's
cluster) may take one, and the kernel dies with ``ZMQError: Address already in use``. With the
``ipc`` transport the channels are files, so there is no port to lose. Pass
``kernel_manager_class=IpcKernelManager`` to nbclient's ``NotebookClient`` (papermill hands its
extra keyword arguments on to it).
"""

import shutil
import tempfile

from jupyter_client.manager import AsyncKernelManager


class IpcKernelManager(AsyncKernelManager):
    """nbclient's kernel manager with every channel on a Unix socket in a folder of its own.

    The sockets' prefix is absolute: the kernel runs in the notebook's folder, the client here, and a
    relative prefix (jupyter_client's default when no connection file is named yet) would point the
    two at different files."""

    def __init__(self, **kwargs):
        self._socket_dir = tempfile.mkdtemp(prefix="nbk-")
        kwargs.setdefault("transport", "ipc")
        kwargs.setdefault("ip", f"{self._socket_dir}/k")
        super().__init__(**kwargs)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)  # removes the socket files
        if not restart:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
