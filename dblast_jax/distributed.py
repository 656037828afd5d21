"""Multi-process runs: start-up for launchers run once per host, meshes, barriers.

`initialize` calls `jax.distributed.initialize` from explicit arguments, else from the
environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), or with no
arguments at all (`auto=True`: Cloud TPU pods, SLURM detect the cluster). One process
(no count, or a count of 1) is a no-op. CPU hosts need cross-process collectives
(gloo) for the barriers, set before the runtime starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from dblast_jax import errors, sharding

__all__ = ["initialize", "local_mesh", "mesh_shape", "define_cluster_flags",
           "add_cluster_args", "initialize_from", "barrier", "setup_error",
           "check_address", "mesh_arg"]

CPU_COLLECTIVES = ("gloo", "mpi", "none")  # jax_cpu_collectives_implementation's values


def check_address(text: Optional[str]) -> Optional[str]:
    """A coordinator address HOST:PORT (port 1 .. 65535), returned as given; ValueError
    naming the expected form otherwise."""
    if text in (None, ""):
        return text
    host, _, port = str(text).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address {text!r}: expected HOST:PORT, e.g. "
                         "10.0.0.2:1234")
    return text


def _argparse_check(check, name: str):
    """An argparse `type=` from a checker that raises ValueError."""
    import argparse

    def convert(text: str):
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    convert.__name__ = name
    return convert


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, auto: bool = False,
               cpu_collectives: Optional[str] = "gloo") -> int:
    """Start this process's part of a multi-process JAX run; returns the process count
    the arguments ask for (1: nothing was started). ValueError when a count > 1 lacks a
    coordinator address or a process id."""
    if auto:
        jax.distributed.initialize()
        return jax.process_count()
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if num is None or num <= 1:
        return 1
    if address is None or pid is None:
        raise ValueError(f"{num} processes need a coordinator address and a process id "
                         "(flags, or JAX_COORDINATOR_ADDRESS / JAX_PROCESS_ID)")
    if not 0 <= pid < num:
        raise ValueError(f"process id {pid} is outside 0 .. {num - 1}")
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
    return num


def initialize_from(opts) -> int:
    """`initialize` from parsed flags / arguments that `define_cluster_flags` or
    `add_cluster_args` declared (absl FLAGS or an argparse namespace)."""
    return initialize(opts.coordinator_address, opts.num_processes, opts.process_id,
                      auto=opts.auto_distributed, cpu_collectives=opts.cpu_collectives)


def define_cluster_flags() -> None:
    """The absl flags of a run over several processes (one per host), the same in every
    launcher in launch/."""
    from absl import flags
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 "
                        "(multi-process); env JAX_COORDINATOR_ADDRESS")
    flags.DEFINE_integer("num_processes", None, "number of processes; env JAX_NUM_PROCESSES",
                         lower_bound=1)
    flags.DEFINE_integer("process_id", None, "this process's index; env JAX_PROCESS_ID",
                         lower_bound=0)
    flags.DEFINE_bool("auto_distributed", False, "jax.distributed.initialize() with no "
                      "arguments (Cloud TPU pods, SLURM: the cluster is detected)")
    flags.DEFINE_enum("cpu_collectives", "gloo", list(CPU_COLLECTIVES),
                      "CPU cross-process collectives (multi-process CPU runs)")

    def valid_address(value) -> bool:
        try:
            check_address(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True

    flags.register_validator("coordinator_address", valid_address)


def add_cluster_args(parser, share: str) -> None:
    """The same flags for an argparse (`dblast`) sub-command; `share` says how the work
    is shared out."""
    import argparse
    g = parser.add_argument_group(f"several processes (one per host; {share})")
    g.add_argument("--coordinator-address", type=_argparse_check(check_address, "address"),
                   help="host:port of process 0; env JAX_COORDINATOR_ADDRESS")
    g.add_argument("--num-processes", type=errors.int_arg(1, "2"), help="env JAX_NUM_PROCESSES")
    g.add_argument("--process-id", type=errors.int_arg(0, "0"), help="env JAX_PROCESS_ID")
    g.add_argument("--auto-distributed", action="store_true",
                   help="jax.distributed.initialize() with cluster detection (TPU pods, SLURM)")
    g.add_argument("--cpu-collectives", default="gloo", choices=CPU_COLLECTIVES,
                   help=argparse.SUPPRESS)


def mesh_shape(spec: Optional[str]) -> Optional[tuple[int, int, int]]:
    """'data,fsdp,tensor' (e.g. '2,2,2' or '-1,1,1') -> its three integers; None or ''
    -> None. ValueError names the expected form."""
    if not spec:
        return None
    try:
        shape = tuple(int(x) for x in str(spec).split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise ValueError(f"mesh {spec!r}: expected three integers data,fsdp,tensor "
                         "(e.g. 2,2,2 or -1,1,1)")
    return shape


def mesh_arg(text: str) -> str:
    """An argparse `type=` for a --mesh flag: 'data,fsdp,tensor' checked at parse time,
    returned as given."""
    return _argparse_check(mesh_shape, "mesh")(text)


def local_mesh(spec: Optional[str]):
    """'data,fsdp,tensor' (e.g. '2,1,1' or '-1,1,1') -> a Mesh over *this process's*
    devices (a per-process job such as corpus regeneration needs no cross-process
    collectives); None or '' -> None (one device)."""
    shape = mesh_shape(spec)
    return None if shape is None else sharding.make_mesh(*shape, devices=jax.local_devices())


# ---- after the start: every process calls these at the same point -------------------------------

def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def setup_error(error: Optional[Exception], what: str, shared_file: Path
                ) -> Optional[Exception]:
    """(Every process, > 1) process 0's set-up outcome (`error`, None when it succeeded;
    the others pass None), and a check that every process sees `shared_file`, which
    process 0 just wrote: the output folder must be one folder shared by all hosts."""
    ok = np.asarray(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not int(ok) and error is None:
        error = ValueError(f"process 0 refused the {what} into {shared_file.parent} (its "
                           "output says why)")
    if error is None:
        return shared_file_error(shared_file)
    return error


def shared_file_error(shared_file: Path) -> Optional[Exception]:
    """(Every process, > 1) None when every process sees `shared_file`, which process 0
    just wrote, else the error naming those that do not."""
    seen = np.asarray(multihost_utils.process_allgather(
        np.int32(shared_file.is_file()))).reshape(-1)
    if seen.all():
        return None
    blind = [int(i) for i in np.flatnonzero(seen == 0)]
    return ValueError(
        f"processes {blind} do not see {shared_file}, which process 0 just wrote: with "
        "several processes --out must be one shared folder (NFS, Filestore, a gcsfuse "
        "bucket) at the same path on every host")
