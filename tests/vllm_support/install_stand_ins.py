"""Put the stand-ins of stand_ins/ into a vLLM Python tree that lacks vLLM's compiled files (a GPU
machine with vLLM 0.33.0's sources but not its .so files):

    python tests/vllm_support/install_stand_ins.py VLLM_PACKAGE_DIR   # the folder holding vllm/'s
                                                                       # __init__.py

    stand_ins/_C_stable_libtorch.py      -> vllm/_C_stable_libtorch.py
    stand_ins/_moe_C_stable_libtorch.py  -> vllm/_moe_C_stable_libtorch.py
    stand_ins/vllm_flash_attn.py         -> vllm/vllm_flash_attn/__init__.py (the original kept as
                                            __init__.py.orig)

A file of the same name that is already there is left alone and named in the output.
"""

import os
import shutil
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_ins")
TARGETS = {"_C_stable_libtorch.py": "_C_stable_libtorch.py",
           "_moe_C_stable_libtorch.py": "_moe_C_stable_libtorch.py",
           "vllm_flash_attn.py": os.path.join("vllm_flash_attn", "__init__.py")}


def install(vllm_dir: str) -> None:
    if not os.path.isfile(os.path.join(vllm_dir, "__init__.py")):
        raise SystemExit(f"{vllm_dir} is not the vllm package folder (no __init__.py)")
    for source, target in TARGETS.items():
        dest = os.path.join(vllm_dir, target)
        if source == "vllm_flash_attn.py" and os.path.exists(dest):
            if not os.path.exists(dest + ".orig"):
                shutil.move(dest, dest + ".orig")
        elif os.path.exists(dest):
            print(f"kept {dest} (already there)")
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(os.path.join(HERE, source), dest)
        print(f"installed {dest}")


if __name__ == "__main__":
    install(sys.argv[1])
