"""Compile-only GPU targets: an H100 or H200 described by its specification.

XLA's GPU compiler, in jax's CUDA plugin, compiles for a target described by
a ``GpuTargetConfigProto`` without a GPU (deviceless compilation, with
``JAX_PLATFORMS=cpu``): ``ok.blockwise.plan`` and the benchmarks read the
compiled program's memory and schedule for a card the machine lacks.

    mesh = gpu_targets.gpu_mesh("h200")   # a one-device mesh to compile for
"""

import jax
from jax.experimental import topologies

# Bandwidths for the estimate (bytes/s): HBM3e of the H200 and HBM3 of the
# H100 SXM (NVIDIA's data sheets), and PCIe 5.0 x16 at the 32 GiB/s that
# XLA's Hopper specifications give.
HBM = {"h200": 4.8e12, "h100": 3.35e12}
PCIE = 32 * 2**30


# -- the targets ------------------------------------------------------------
# A GpuTargetConfigProto in text form, with the figures of XLA's Hopper
# specifications (xla/backends/gpu/target_config/specs); the proto compiled
# into jax's CUDA plugin 0.10 has no collective_memory_granularity field.

def _rate(key: int, units: int, ops: int, ghz: float) -> str:
  return (f"rate_infos {{ key: {key} value {{ clock_rate_ghz: {ghz} "
          f"units_per_core: {units} ops_per_clock: {ops} }} }}")


def _hopper(name: str, hbm_bytes_per_s: float, memory: int, mem_khz: int,
            dnn: tuple[int, int, int]) -> str:
  scalar = " ".join(_rate(k, u, o, 1.98) for k, u, o in (
      (4, 64, 1), (8, 64, 1), (10, 128, 2), (11, 128, 1), (12, 64, 1),
      (16, 128, 2)))
  matrix = " ".join(_rate(k, 4, o, 1.98 if k == 12 else 1.8295201)
                    for k, o in ((2, 1024), (6, 1024), (10, 512), (11, 256),
                                 (12, 32), (16, 512), (19, 1024), (20, 1024),
                                 (23, 1024), (24, 1024), (25, 1024),
                                 (28, 1024), (29, 1024), (33, 1024),
                                 (35, 1024), (36, 1024)))
  info = f"""
    threads_per_block_limit: 1024 threads_per_warp: 32
    shared_memory_per_block: 49152 shared_memory_per_core: 233472
    threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
    block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
    block_dim_limit_z: 65535 memory_bandwidth: {int(hbm_bytes_per_s)}
    l2_cache_size: 52428800 clock_rate_ghz: 1.98
    device_memory_size: {memory} shared_memory_per_block_optin: 232448
    cuda_compute_capability {{ major: 9 feature_extension: ACCELERATED_FEATURES }}
    registers_per_core_limit: 65536 registers_per_block_limit: 65536
    scalar_unit_description {{ {scalar} }}
    matrix_unit_description {{ {matrix} }}
    thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
    device_vendor: "NVIDIA Corporation"
    platform_version: "Compute Capability 9.0a"
    model_str: "sm_9.0a with {memory}B RAM, 132 cores, 1980000KHz clock, {mem_khz}KHz mem clock, 52428800B L2$"
    device_address_bits: 64 pcie_bandwidth: {PCIE} ecc_enabled: true
    name: "{name}" driver_version: "13.0.0" runtime_version: "12.8.0"
    compile_time_toolkit_version: "12.8.0" dnn_version: "{'.'.join(map(str, dnn))}"
    cub_version: "3.1.2" device_interconnect_info {{ active_links: 18 }}"""
  return (f"gpu_device_info {{{info}\n}}\nplatform_name: \"CUDA\"\n"
          f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} "
          f"patch: {dnn[2]} }}\ndevice_description_str: \"{name}\"\n")


#: Each target's device memory in bytes (its ``device_memory_size``).
MEMORY = {"h200": 151397597184, "h100": 84942979072}

TARGETS = {
    "h200": lambda: _hopper("NVIDIA H200 141GB HBM3e", HBM["h200"],
                            MEMORY["h200"], 3750000, (9, 10, 0)),
    "h100": lambda: _hopper("NVIDIA H100 80GB HBM3", HBM["h100"],
                            MEMORY["h100"], 2619000, (8, 9, 4)),
}


def gpu_mesh(target: str) -> jax.sharding.Mesh:
  """A one-device mesh of a compile-only GPU described by ``TARGETS``.

  Raises:
    ValueError: for a target not in ``TARGETS``.
    RuntimeError: without jax's CUDA plugin at jax's version, or where the
      plugin did not start: on a machine without a GPU it looks for CUDA's
      libraries, and starts without them only where jax's platforms were
      set to the CPU before its backends started.
  """
  if target not in TARGETS:
    raise ValueError(f"unknown GPU target {target!r}: one of "
                     f"{sorted(TARGETS)}")
  try:
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=TARGETS[target](), topology="1x1x1")
  except Exception as e:  # the plugin missing, or another jax version's
    raise RuntimeError(
        f"compiling for {target!r} without a GPU needs jax's CUDA plugin at "
        "jax's version (in the clone: pip install -e \".[gpu-aot]\", 3.7 GB) "
        "and, on a machine without a GPU, jax's platforms set to the CPU "
        "before anything starts its backends (JAX_PLATFORMS=cpu, or "
        "jax.config.update(\"jax_platforms\", \"cpu\") first): the plugin "
        f"looks for CUDA otherwise ({type(e).__name__}: {e})") from e
  return topologies.make_mesh(topo, (1,), ("x",))
