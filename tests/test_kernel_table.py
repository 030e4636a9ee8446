"""The host's kernel table (engine/gpu/kernels.py) agrees with cuda/*.cu: the explicit instantiations CI's
nvcc build compiles (and checks for spills) are exactly the instances NVRTC may be asked for, and the
constants the host reads from the sources are the model's."""
import re

import pytest

from engine.config import GDN_CHUNK
from engine.gpu import kernels


def _instantiated(file: str) -> set[str]:
    """Template instances of the file's `#ifndef __CUDACC_RTC__` block, its *_INST macros expanded."""
    text = (kernels.CUDA_DIR / file).read_text().replace("\\\n", " ")
    blocks = re.findall(r"#ifndef __CUDACC_RTC__\n(.*?)#endif", text, re.S)
    assert blocks, f"{file}: no explicit-instantiation block"
    body = "\n".join(blocks)
    macros = {m[0]: ([p.strip() for p in m[1].split(",")], m[2])
              for m in re.findall(r"#define\s+(\w+)\(([^)]*)\)(.*)", body)}
    body = re.sub(r"#define.*", "", body)
    for _ in range(len(macros)):  # macros may expand to other macros' calls
        for name, (params, expansion) in macros.items():
            def expand(m, params=params, expansion=expansion):
                out = expansion
                for p, v in zip(params, m.group(1).split(",")):
                    out = re.sub(rf"\b{p}\b", v.strip(), out)
                return out
            body = re.sub(rf"\b{name}\(([^)]*)\)", expand, body)
    found = re.findall(r"template\s+__global__\s+void\s+(\w+)<([^>]*)>", body)
    return {f"{n}<{', '.join(a.strip() for a in args.split(','))}>" for n, args in found}


@pytest.mark.parametrize("file", sorted(kernels.INSTANCES))
def test_instances_match_the_sources(file):
    assert _instantiated(file) == set(kernels.INSTANCES[file])


def test_every_file_with_template_kernels_is_in_the_table():
    for path in kernels.CUDA_DIR.glob("*.cu"):
        if re.search(r"template\s*<[^>]*>\s*__global__", path.read_text()):
            assert path.name in kernels.INSTANCES, path.name


def test_constants_read_from_the_sources():
    assert kernels.define("gdn.cu", "GDN_C") == GDN_CHUNK
    assert kernels.define("attention_prefill.cu", "PF_ROWS") % 16 == 0
    with pytest.raises(KeyError, match="no `#define NOPE"):
        kernels.define("gdn.cu", "NOPE")


def test_needed_programs_exist(tiny_dir, tiny3_dir):
    from engine.config import ModelConfig
    for d in (tiny_dir, tiny3_dir):
        cfg = ModelConfig.from_dir(d)
        for inv in (False, True):
            progs = kernels.needed(cfg, inv)
            assert all(inst is None or inst in kernels.INSTANCES[f] for f, inst in progs)
            insts = {inst for _, inst in progs}
            assert all(f"gdn_chunk_state<{cfg.lin_k_dim}, {c}>" in insts for c in kernels.GDN_CLUSTERS)
            assert any(inst == "gemm_inv<1>" for _, inst in progs) == inv
