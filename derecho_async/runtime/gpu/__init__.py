"""GPU data planes: device arrays between members, by CUDA IPC (one host) or NCCL broadcasts.

Theory of operation: DESIGN.md §6.6 and §6.7. The modules, from the wire up:

- :mod:`.pool`: the range allocator and the pool announcement (pure);
- :mod:`.descriptor`: array specs and descriptors, their wire encoding (pure);
- :mod:`.waiter`, :mod:`.completions`: noticing finished GPU work without blocking the loop;
- :mod:`.ipc_pool`, :mod:`.ipc_send`, :mod:`.ipc_receive`, :mod:`.ipc`: the CUDA IPC plane
  (:class:`~.ipc.IpcPlane`: its state and pool, sending half, receiving half, views and the
  Plane protocol);
- :mod:`.nccl_plan` (pure), :mod:`.nccl`: the NCCL plane (:class:`~.nccl.NcclPlane`);
- :mod:`.selection`: which GPU planes a member runs.

Importing this package or any module of it never imports CuPy: the planes import it when made.
"""
