"""OpenCL platforms and devices: the lazy probe (pyopencl imported only here), what `auto` may
pick (GPU or accelerator devices, never a CPU device such as PoCL's), and the listing for
`colibri backends`."""
from __future__ import annotations

from colibri_edge.errors import ColibriError, COLIBRI_ERR_UNAVAILABLE

INSTALL_HINT = ("no OpenCL platform found: install an ICD, e.g. `pip install pocl-binary-distribution` "
                "(PoCL on the CPU, for testing), Debian's `pocl-opencl-icd`, or the board vendor's Mali "
                "driver (libmali with its /etc/OpenCL/vendors/*.icd)")


# -- probing ---------------------------------------------------------------------------------------
def _cl():
    try:
        import pyopencl as cl
        return cl
    except ImportError as e:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"pyopencl is not installed ({e}); "
                           "`pip install 'colibri-edge[opencl]'` (pyopencl + pocl-binary-distribution)") from None


def _platforms(cl):
    try:
        return cl.get_platforms()
    except cl.Error:          # PLATFORM_NOT_FOUND_KHR from the ICD loader when no ICD is installed
        return []


def _is_gpu_like(dev, cl):
    """GPU or accelerator, never a CPU device (PoCL's): what backend='auto' may pick."""
    t = dev.type
    return bool(t & (cl.device_type.GPU | cl.device_type.ACCELERATOR)) and not (t & cl.device_type.CPU)


def _all_devices(cl):
    out = []
    for p in _platforms(cl):
        try:
            out += [(p, d) for d in p.get_devices()]
        except cl.Error:      # a platform with no devices
            pass
    return out


def probe(for_auto=False):
    """-> (ok, detail). for_auto: only GPU/accelerator devices count (never a CPU device)."""
    try:
        cl = _cl()
    except ColibriError as e:
        return False, e.message
    devs = _all_devices(cl)
    if not devs:
        return False, INSTALL_HINT
    usable = [(p, d) for p, d in devs if _is_gpu_like(d, cl)] if for_auto else devs
    if not usable:
        names = ", ".join(f"{d.name.strip()} ({cl.device_type.to_string(d.type)})" for _, d in devs)
        return False, (f"no OpenCL GPU or accelerator device (found only: {names}); auto never picks a CPU "
                       "device, ask for backend='opencl' explicitly to use it")
    return True, "; ".join(f"{p.name.strip()}: {d.name.strip()}" for p, d in usable)


def describe_platforms():
    """Every OpenCL platform and device, for `colibri backends`. -> list of dicts, one per device:
    platform, platform_version, device, device_version, type, compute_units, global_mem_bytes,
    max_work_group_size, fp16 (cl_khr_fp16 reported). Empty when pyopencl or an ICD is missing."""
    try:
        cl = _cl()
    except ColibriError:
        return []
    return [{"platform": p.name.strip(), "platform_version": p.version.strip(), "device": d.name.strip(),
             "device_version": d.version.strip(), "type": cl.device_type.to_string(d.type),
             "compute_units": int(d.max_compute_units), "global_mem_bytes": int(d.global_mem_size),
             "max_work_group_size": int(d.max_work_group_size), "fp16": "cl_khr_fp16" in d.extensions.split()}
            for p, d in _all_devices(cl)]


def format_platforms(rows=None) -> str:
    """describe_platforms() as text lines."""
    rows = describe_platforms() if rows is None else rows
    if not rows:
        return INSTALL_HINT
    return "\n".join(f"{r['platform']} ({r['platform_version']}): {r['device']} [{r['type']}], "
                     f"{r['device_version']}, {r['compute_units']} CUs, "
                     f"{r['global_mem_bytes'] / 2**30:.1f} GiB, fp16 {'yes' if r['fp16'] else 'no'}"
                     for r in rows)
