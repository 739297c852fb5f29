"""Runs a test's body on several gloo ranks of this machine (``torch.multiprocessing.spawn``).

:func:`on_gloo_ranks` starts ``world`` processes, initialises a gloo process group in each (on a free
local port), calls ``fn(rank, *args)`` and destroys the group; an assertion failing on any rank
fails the test with that rank's traceback. :data:`needs_gloo` skips where torch has no gloo.

A rank that finished cleanly leaves through ``os._exit(0)``, not the interpreter's shutdown: in 4 of 275
runs of a sharded-sampling test on a loaded 2-core machine, rank 0 (the one serving the rendezvous store) aborted in
torch's C++ teardown after its Python code had returned ("terminate called without an active
exception", the fault handler's stack with no Python frame), which failed a test whose every
assertion had passed. A failing rank still exits through the interpreter, its traceback reported.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        fn(rank, *args)
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """End a rank whose test body passed without the interpreter's shutdown (see the module's note)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def on_gloo_ranks(fn: Callable[..., None], world: int = 2, *args: Any) -> None:
    """``fn(rank, *args)`` on ``world`` gloo ranks (``fn`` must be a module-level function)."""
    mp.spawn(_rank, args=(world, _free_port(), fn, args), nprocs=world, join=True)


def _lightning_rank(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    # what a launcher (torchrun, SLURM) sets: Lightning then joins these processes instead of starting its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _leave()


def on_lightning_ranks(fn: Callable[..., None], world: int = 2, *args: Any) -> None:
    """``fn(rank, *args)`` in ``world`` processes set up as a launcher sets up ranks: a Lightning
    ``Trainer`` or ``Fabric`` built there (``devices=world``) joins them and starts the process group."""
    mp.spawn(_lightning_rank, args=(world, _free_port(), fn, args), nprocs=world, join=True)
