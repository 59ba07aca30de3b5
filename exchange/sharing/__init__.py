"""Exchange across processes on one machine: ``tx.share``, ``tx.attach``, ``tx.ShareHandle``
and the reducer that lets ``multiprocessing`` Queues and Pipes carry a ``tx.Tensor``.

How it works (docs/processes.md says it for users):

* Which memory travels, and how, is its memory channel's (exchange/channels/, chosen by
  the memory's device type as its backend declares): CPU memory lives in anonymous
  shared memory (``exchange.channels.memfd.SharedMemory``: a sealed ``memfd``, never a
  named segment in /dev/shm), blocks of a few large arenas per process
  (``exchange.channels.memfd.Arenas``), which a receiver maps once each and keeps while
  it uses them; ``tx.share(t, isolated=True)``: memory of its own. CUDA memory comes
  from an IPC-enabled cuda.core pool (exchange/channels/cuda.py). Other memory is
  copied into such memory first.
* A process that shares serves its memory from one Unix-domain socket (``SOCK_SEQPACKET``
  in Linux's abstract namespace: no file to leave behind) and one background thread,
  started by the first ``share`` and asleep in a selector while nothing happens. A
  receiver keeps one connection to each sender open: an attach asks over it and gets
  the memory's (or its arena's) file descriptor back (``SCM_RIGHTS``); a multiprocessing
  hand-off from an arena mapped already asks nothing (its *take* follows, unasked);
  releases and takes go in batches on it. The sender sends only answers on it, and the
  *fences* of ``drop_leases`` (which ends a hand-off's lease only once every receiver
  mapping an arena has answered), read by the receiver's background thread.
* Ownership: a handle in transit holds its memory (a *lease*, a holder of the record)
  until its first attach, its ``close()`` or the sender's exit. Each attaching process
  is one holder of the sender's record (``process <pid>``, counted in
  ``stats()["remote_holders"]``) until it releases its last Tensor over the memory, or
  dies: the kernel then closes its connection and the sender drops its holds at once.
  A receiver watches each sender with a pidfd and closes its connection (and, for
  CUDA, its views) when the sender dies.
* CUDA release is stream-ordered across processes: the receiver unmaps on its stream,
  records an IPC event after that and sends it with the release; the sender's ordering
  stream waits on it, and the sender's free waits for that stream.

The package, by concept (each module says what it owns):

* ``handle``: the public calls and the handle;
* ``protocol``: the wire: the handle's fields (``HandleFields``) and their check, the
  messages, the waits (``settings``, the one configuration object:
  ``exchange.sharing.settings``);
* ``serving``: the sending side: the server socket, the shared entries, their leases,
  the receivers connected and their holds;
* ``receiving``: the receiving side: the connections to senders, the mappings made here,
  the senders' arenas mapped here;
* ``peers``: connecting to a sender and proving it is the process that made the handle;
* ``loop``: the one background thread both sides use.

Nothing here names a device kind or imports a device's module: the memory channels do
(exchange/channels/), loaded on first use of their memory. And ``import exchange`` does not
import this package: ``tx.share``, ``tx.attach`` and ``tx.ShareHandle`` load it on first
use, and the multiprocessing reducer when a Tensor is first sent.
"""

from __future__ import annotations

from .handle import ShareHandle, _rebuild_handle, _rebuild_tensor, attach, drop_leases, reduce_tensor, share
from .protocol import settings

__all__ = ["ShareHandle", "share", "attach", "drop_leases", "reduce_tensor", "settings"]
