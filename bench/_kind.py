"""The CPU kind a bench result is filed under: vendor and kernel set, e.g. xeon-avx512amx, epyc-avx512,
epyc-avx2only, epyc-avx512-avx2kernels (ATEN_CPU_CAPABILITY chose narrower kernels on an AVX-512 CPU).

    python bench/_kind.py          # prints the kind of the CPU this runs on
"""

from pathlib import Path

import torch


def cpu_kind() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1] for line in flags.splitlines() if line.startswith("model name")), "")
    vendor = ("xeon" if "Xeon" in name else "epyc" if "EPYC" in name
              else "intel" if "Intel" in name else "amd" if "AMD" in name else "cpu")
    cap = torch.backends.cpu.get_cpu_capability().lower()
    amx = "amx" if " amx_tile" in flags else ""
    if cap == "avx512":
        kind = "avx512" + amx
    elif " avx512f" in flags:
        kind = f"avx512{amx}-{cap}kernels"
    else:
        kind = cap + "only" if cap == "avx2" else cap
    return f"{vendor}-{kind}"


if __name__ == "__main__":
    print(cpu_kind())
