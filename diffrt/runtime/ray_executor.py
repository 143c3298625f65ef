"""Ray executor: the ranks of one engine as Ray actors in a placement group.

One bundle per rank (its device and ``ray_cpus_per_rank`` CPUs), PACK:
ranks share a node where they fit, spill to others where they do not. The
ranks run the same serve loop as a spawned worker (``worker_core.serve``),
on a thread of their actor; the messages travel as Ray actor calls:

- requests: ``push(seq, data)`` to every rank (numbered: a threaded actor
  may run two calls out of order, the serve loop must not);
- results: the pump keeps one ``poll`` call outstanding per rank, which
  returns what the rank sent (or an empty list after a short wait); a dead
  actor fails that call at once, so a dead rank fails pending work within
  one poll;
- frees of output slots: ``push_free`` to rank 0.

The output arena: on the engine's node, rank 0 maps the engine's own memfd
(opened through ``/proc/<pid>/fd``), the same zero-copy path as a spawned
worker. On another node it writes into an arena of its own, and the pump,
before it routes an OUTPUT_READY, fetches the slots it names through the Ray
object store into the same offsets of the engine's arena (rank 0 reuses a
slot only after the engine freed it, so the mirror stays consistent).
``ray_output_transport="object_store"`` forces that path on one node.

Ray is an optional dependency (``pip install 'diffrt[ray]'``); the engine
joins the Ray instance this process is connected to, or starts a local one.
"""

from __future__ import annotations

import heapq
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from diffrt.runtime.messages import FreeSlots, OutputReady, Shutdown, encode, result_decoder
from diffrt.runtime.pumped_executor import PumpedExecutor, WorkerDied
from diffrt.runtime.types import ExecutorConfig

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: how long one ``poll`` call waits in the actor for a result
POLL_WAIT_S = 0.5
RAY_EXTRA_HINT = "Ray is not installed: pip install 'diffrt[ray]'"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(RAY_EXTRA_HINT) from exc
    return ray


class RankActor:
    """One rank inside a Ray actor (made remote by ``RayExecutor``)."""

    def __init__(self, rank: int, env: dict[str, str], pin_var: str | None = None) -> None:
        os.environ.update(env)
        pin_to_ray_devices(pin_var)  # before anything initialises the device
        self.rank = rank
        self._results: queue.Queue[bytes] = queue.Queue()
        self._frees: queue.Queue[bytes] = queue.Queue()
        self._init: bytes | None = None
        self._pending: list[tuple[int, bytes]] = []  # heap of (seq, data) not yet served
        self._next_seq = 0
        self._ready = threading.Condition()
        self._arena: Any = None
        self._thread: threading.Thread | None = None

    def where(self) -> tuple[str, str, int]:
        """(node id, node address, a free TCP port there) — rank 0's make the
        process group's rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port)

    def start(self, init: bytes, arena_bytes: int, arena_source: tuple[int, int, int] | None,
              required: bool = False) -> str:
        """Start the serve loop; rank 0 maps the engine's arena (``arena_source``:
        the engine's (pid, fd, inode) on this node) or an arena of its own.
        Returns the output path taken ("shm" or "object_store"): the engine's
        memfd is used only when the file opened is that very memfd (another
        PID namespace would show another process); ``required`` makes a
        failure an error instead of a fallback."""
        from diffrt.runtime.shm_transport import Arena

        path = "shm"
        if self.rank == 0:
            self._arena = self._engine_arena(arena_source, arena_bytes) if arena_source else None
            if self._arena is None:
                if required:
                    raise RuntimeError("rank 0 cannot map the engine's output arena "
                                       "(ray_output_transport='shm')")
                self._arena, path = Arena.create(arena_bytes), "object_store"
        self._init = init
        self._thread = threading.Thread(target=self._serve, name=f"diffrt-rank-{self.rank}",
                                        daemon=True)
        self._thread.start()
        return path

    @staticmethod
    def _engine_arena(source: tuple[int, int, int], size: int) -> Any:
        from diffrt.runtime.shm_transport import Arena

        pid, fd, inode = source
        try:
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError:
            return None
        if os.fstat(handle).st_ino != inode:
            os.close(handle)
            return None
        return Arena.attach(handle, size)

    def _serve(self) -> None:
        from diffrt.runtime.messages import free_decoder
        from diffrt.runtime.worker_core import build_core, leave_process_group, serve

        send_lock = threading.Lock()

        def send(msg: Any) -> None:
            data = encode(msg)
            with send_lock:
                self._results.put(data)

        def frees(timeout: float) -> Any:
            try:
                return free_decoder.decode(self._frees.get(timeout=timeout))
            except queue.Empty:
                return None

        try:
            serve(self._recv, send, lambda init: build_core(init, send, self._arena, frees))
        except Exception:
            # as a worker process would: the actor ends, its pending poll fails,
            # and the executor fails the work (a RankFailure, or a broken loop)
            logger.exception("rank %d: serve loop failed; ending the actor", self.rank)
            give_up_at = time.monotonic() + 5.0  # its error reply reaches the engine first
            while not self._results.empty() and time.monotonic() < give_up_at:
                time.sleep(0.05)
            time.sleep(POLL_WAIT_S)
            os._exit(1)
        finally:
            leave_process_group()

    def _recv(self) -> bytes | None:
        """The next request in the executor's order (InitWorker first)."""
        if self._init is not None:
            init, self._init = self._init, None
            return init
        with self._ready:
            while not (self._pending and self._pending[0][0] == self._next_seq):
                self._ready.wait()
            self._next_seq += 1
            return heapq.heappop(self._pending)[1]

    def push(self, seq: int, data: bytes) -> None:
        with self._ready:
            heapq.heappush(self._pending, (seq, data))
            self._ready.notify_all()

    def push_free(self, data: bytes) -> None:
        self._frees.put(data)

    def poll(self, wait_s: float) -> list[bytes]:
        """What this rank sent since the last poll (waits up to ``wait_s`` for
        the first message)."""
        out: list[bytes] = []
        try:
            out.append(self._results.get(timeout=wait_s))
            while True:
                out.append(self._results.get_nowait())
        except queue.Empty:
            return out

    def read(self, offset: int, nbytes: int) -> Any:
        """Bytes of this rank's own arena (the object-store output path)."""
        return self._arena.bytes_view(offset, nbytes).numpy()  # serialised on return

    def stopped(self, wait_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(wait_s)
        return self._thread is None or not self._thread.is_alive()

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(PumpedExecutor):
    #: actors on other nodes cannot map the engine's memfd: requests with
    #: input images are refused at submission on this backend
    maps_inputs = False
    def __init__(self, config: ExecutorConfig):
        super().__init__(config)
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=config.ray_address, ignore_reinit_error=True,
                     log_to_driver=False)
        self._ray = ray
        self._death: str | None = None
        self._seq = 0
        self._mirror = False
        self._actors: list[Any] = []
        self._pg: Any = None
        self._polls: dict[Any, int] = {}  # outstanding poll ref -> rank
        self.router = self._make_router(self._send_free)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_pg = remove_placement_group
        from diffrt.platforms import current_platform

        try:
            bundle = ray_bundle(current_platform, config.ray_cpus_per_rank)
            self._pg = placement_group([dict(bundle) for _ in range(config.world_size)],
                                       strategy="PACK")
            try:
                ray.get(self._pg.ready(), timeout=config.startup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"Ray could not place {config.world_size} rank(s) of "
                                   f"{bundle} within {config.startup_timeout_s:g} s "
                                   f"(cluster: {ray.cluster_resources()})") from None
            actor_cls = ray.remote(RankActor)
            env = rank_environment(config.worker_env)
            for rank in range(config.world_size):
                self._actors.append(actor_cls.options(
                    num_cpus=bundle["CPU"], **ray_device_options(current_platform, 1),
                    max_concurrency=4, max_restarts=0, runtime_env={"env_vars": env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._pg, placement_group_bundle_index=rank),
                ).remote(rank, env, ray_pinning_var(current_platform)))
            node, address, port = ray.get(self._actors[0].where.remote(),
                                          timeout=config.startup_timeout_s)
            here = ray.get_runtime_context().get_node_id()
            self._mirror = (config.ray_output_transport == "object_store"
                            or (config.ray_output_transport == "auto" and node != here))
        except BaseException:
            self.shutdown()
            raise
        self._launch(self._start_ranks, f"tcp://{address}:{port}" if config.world_size > 1 else None)

    def _start_ranks(self, init_messages: list[bytes]) -> None:
        source = None if self._mirror else (os.getpid(), self.arena.fd,
                                            os.fstat(self.arena.fd).st_ino)
        paths = self._ray.get([
            actor.start.remote(msg, self.arena.size, source,
                               self.config.ray_output_transport == "shm")
            for actor, msg in zip(self._actors, init_messages, strict=True)],
            timeout=self.config.startup_timeout_s)
        self._mirror = paths[0] == "object_store"
        for rank, actor in enumerate(self._actors):
            self._polls[actor.poll.remote(POLL_WAIT_S)] = rank

    @property
    def actors(self) -> list[Any]:
        """The ranks' actor handles, in rank order."""
        return list(self._actors)

    @property
    def worker_pids(self) -> list[int]:
        return self._ray.get([a.pid.remote() for a in self._actors], timeout=30)

    @property
    def output_transport(self) -> str:
        """"shm" (rank 0 writes into this process's arena) or "object_store"."""
        return "object_store" if self._mirror else "shm"

    # -- PumpedExecutor hooks -----------------------------------------------------------
    def _send_free(self, msg: FreeSlots) -> None:
        if self._actors and self._death is None:
            self._actors[0].push_free.remote(encode(msg))

    def _broadcast(self, data: bytes) -> None:
        if self._death is not None:
            raise WorkerDied(self._death)
        seq, self._seq = self._seq, self._seq + 1
        for actor in self._actors:
            actor.push.remote(seq, data)

    def _poll_results(self, timeout: float) -> list[bytes]:
        if self._death is not None:
            raise WorkerDied(self._death)
        ray = self._ray
        ready, _ = ray.wait(list(self._polls), num_returns=1, timeout=timeout)
        if ready:  # and whatever else is ready by now
            ready, _ = ray.wait(list(self._polls), num_returns=len(self._polls), timeout=0)
        out: list[bytes] = []
        for ref in ready:
            rank = self._polls.pop(ref)
            try:
                messages = ray.get(ref)
            except Exception as exc:  # RayActorError and kin: the rank is gone
                if not self._stopping.is_set():
                    self._death = (f"worker rank {rank} (Ray actor) died "
                                   f"({type(exc).__name__}); failing all pending work")
                continue
            if rank == 0 and self._mirror:
                self._fetch_outputs(messages)
            out.extend(messages)
            self._polls[self._actors[rank].poll.remote(POLL_WAIT_S)] = rank
        return out

    def _fetch_outputs(self, messages: list[bytes]) -> None:
        """The object-store path: copy the slots an OUTPUT_READY names from rank
        0's arena into the same offsets of this one, before it is routed."""
        for data in messages:
            msg = result_decoder.decode(data)
            if not isinstance(msg, OutputReady):
                continue
            refs = [(out.slot_offset, self._actors[0].read.remote(out.slot_offset, out.slot_bytes))
                    for out in msg.outputs]
            for offset, ref in refs:
                try:  # read-only, in the object store
                    chunk = self._ray.get(ref, timeout=self.config.output_timeout_s)
                except Exception as exc:
                    raise WorkerDied(f"worker rank 0 (Ray actor): reading its outputs failed "
                                     f"({type(exc).__name__})") from exc
                self.arena.bytes_view(offset, chunk.size).numpy()[:] = chunk

    def _workers_alive(self) -> bool:
        return self._death is None

    def _kill_workers(self) -> bool:
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)
        return True

    def _stop_workers(self) -> None:
        ray = self._ray
        try:
            if self._death is None and self._actors:
                with self._send_lock:  # numbered after every request already sent
                    self._broadcast(encode(Shutdown()))
                give_up_at = time.monotonic() + self.config.shutdown_grace_s
                refs = [a.stopped.remote(self.config.shutdown_grace_s) for a in self._actors]
                ray.wait(refs, num_returns=len(refs),
                         timeout=max(0.1, give_up_at - time.monotonic()))
        except Exception:
            logger.debug("polite stop of the Ray ranks failed", exc_info=True)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.debug("ray.kill failed", exc_info=True)
        try:
            if self._pg is not None:
                self._remove_pg(self._pg)
        except Exception:
            logger.debug("removing the placement group failed", exc_info=True)


def ray_device_options(platform: Platform, devices: int) -> dict[str, Any]:
    """Ray actor options reserving ``devices`` of the platform's devices, under
    the Ray resource that counts them (``Platform.ray_resource``: "GPU" for
    CUDA, ROCm, XPU and MUSA, "NPU" for Ascend; a custom resource must be
    declared with ``ray start --resources``, and Ray then sets no visibility
    variable for it). Nothing on CPU. What Ray cannot do for this platform is
    logged once (``ray_limitation``)."""
    resource = getattr(platform, "ray_resource", None)
    if not resource:
        return {}
    _note_limitation(platform)
    if resource == "GPU":
        return {"num_gpus": devices}
    return {"resources": {resource: devices}}


def ray_bundle(platform: Platform, cpus_per_rank: float) -> dict[str, float]:
    """One rank's placement-group bundle: its CPUs and one device."""
    bundle: dict[str, float] = {"CPU": float(cpus_per_rank)}
    options = ray_device_options(platform, 1)
    if "num_gpus" in options:
        bundle["GPU"] = float(options["num_gpus"])
    bundle.update(options.get("resources", {}))
    return bundle


_noted: set[str] = set()


def ray_limitation(platform: Platform) -> str | None:
    """One line on what Ray cannot do for ``platform`` on this node, or None:
    Ray counts Intel GPUs only through ``dpctl`` (its intel_gpu.py returns 0
    without it), and it has no MUSA accelerator manager."""
    import importlib.util

    name = getattr(platform, "name", "")
    if name == "xpu" and importlib.util.find_spec("dpctl") is None:
        return ("xpu: dpctl is not installed here, and Ray counts Intel GPUs only through "
                "dpctl: a node without it offers no GPU, so ranks that need one are never "
                "placed (pip install dpctl on every node)")
    if name == "musa":
        return ("musa: Ray has no MUSA accelerator manager: MUSA devices are reserved as Ray "
                "GPUs (start each node with ray start --num-gpus N) and each rank and replica "
                "is pinned with MUSA_VISIBLE_DEVICES from ray.get_gpu_ids()")
    return None


def _note_limitation(platform: Platform) -> None:
    note = ray_limitation(platform)
    if note is not None and note not in _noted:
        _noted.add(note)
        logger.warning("%s", note)


def ray_pinning_var(platform: Platform) -> str | None:
    """The visibility variable diffrt must set from ``ray.get_gpu_ids()`` in
    an actor, where Ray's manager for the platform's resource does not set it
    (MUSA under the "GPU" resource); None where Ray pins by itself."""
    if getattr(platform, "ray_sets_visibility", True) or platform.ray_resource != "GPU":
        return None
    return platform.device_control_env_var


def pin_to_ray_devices(var: str | None, environ: Any = None) -> dict[str, str]:
    """Set ``var`` to the devices Ray assigned to this actor or replica (what
    vllm-musa does for MUSA); nothing when ``var`` is None or Ray assigned no
    GPU. Returns what was set. Must run before anything touches the device
    runtime (torch_musa's ``device_count()`` is cached at its first call).

    Ray's ids count the GPUs of the node's ``--num-gpus``; its GPU manager maps
    them through an inherited ``CUDA_VISIBLE_DEVICES`` only (worker.py
    ``get_accelerator_ids_for_accelerator_resource``), never through ``var``.
    So where this process inherited ``var`` (a raylet started with
    ``MUSA_VISIBLE_DEVICES=2,3``), Ray's id i is its i-th entry; otherwise the
    id is the device."""
    if not var:
        return {}
    ids = [str(i) for i in import_ray().get_gpu_ids()]
    if not ids:
        return {}
    environ = os.environ if environ is None else environ
    inherited = [v.strip() for v in environ.get(var, "").split(",") if v.strip()]
    if inherited:
        outside = [i for i in ids if not i.isdigit() or int(i) >= len(inherited)]
        if outside:
            raise RuntimeError(
                f"Ray assigned GPU id(s) {', '.join(outside)}, but this node's {var}="
                f"{environ[var]} lists {len(inherited)} device(s): start the node with "
                f"ray start --num-gpus {len(inherited)}")
        ids = [inherited[int(i)] for i in ids]
    environ[var] = ",".join(ids)
    return {var: environ[var]}


#: environment variables a rank actor inherits from the engine's process (an
#: actor starts from Ray's environment, not the engine's): allocator settings
#: (PYTORCH_*_ALLOC_CONF) and the vendors' runtime settings: Ascend (ASCEND_*,
#: ACL_*, torch_npu's TASK_QUEUE_ENABLE), Intel (ZE_*, SYCL_*, the Unified
#: Runtime's UR_*, IPEX_*), ROCm (HSA_*, HIP_*, MIOPEN_*, HIPBLASLT_*), MUSA
#: (MUSA_*), CUDA's module loading and connection count
FORWARDED_ENV_PREFIXES = ("DIFFRT_", "HF_", "NCCL_", "GLOO_", "HCCL_", "CCL_", "MCCL_",
                          "TORCH_", "OMP_", "MALLOC_", "PYTORCH_", "ASCEND_", "ACL_", "ZE_",
                          "SYCL_", "UR_", "IPEX_", "HSA_", "HIP_", "MIOPEN_", "HIPBLASLT_",
                          "MUSA_")
#: single variables forwarded as well; LD_LIBRARY_PATH because an Ascend
#: rank finds its CANN libraries through it (DeepSpeed exports it to NPU
#: ranks: without it two CANN installs can mix)
FORWARDED_ENV_NAMES = frozenset({"CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS",
                                 "TASK_QUEUE_ENABLE", "LD_LIBRARY_PATH"})
#: device visibility names the engine's node's devices: on an actor, Ray sets
#: (or diffrt pins) the actor's own, which a forwarded value would override or
#: filter again
NOT_FORWARDED = frozenset({"ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES",
                           "ZE_AFFINITY_MASK", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                           "MUSA_VISIBLE_DEVICES"})


def rank_environment(worker_env: dict[str, str]) -> dict[str, str]:
    """What a rank actor starts with (Ray's ``runtime_env``, so glibc's and
    torch's start-up variables take effect): the engine's own variables with
    the prefixes and names above, but no device visibility, then ``worker_env``."""
    env = {k: v for k, v in os.environ.items()
           if (k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV_NAMES)
           and k not in NOT_FORWARDED}
    env.update(worker_env)
    return env


__all__ = ["RankActor", "RayExecutor", "import_ray", "pin_to_ray_devices", "rank_environment",
           "ray_bundle", "ray_device_options", "ray_limitation", "ray_pinning_var"]
