"""The server command the runner builds uses only flags vLLM 0.22.1's OpenAI server defines.

The server mode has never started on the GPU yet; a wrong flag would cost a GPU session's start-up.
The flags are read from the pinned sources: EngineArgs / frontend dataclass fields (vLLM derives
``--field-name`` from each) and explicit ``add_argument("--...")`` calls.
"""

import ast
import glob
import re

import pytest

from dflash_lab.runner import load_matrix
from dflash_lab.vllm_sources import read_source
from dflash_lab.worker import engine_kwargs, server_cli, with_acceptance

SOURCES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py")
CLASSES = ("EngineArgs", "AsyncEngineArgs", "BaseFrontendArgs", "FrontendArgs")


def vllm_flags() -> set[str]:
    flags = set()
    for rel in SOURCES:
        src = read_source(rel)
        flags |= set(re.findall(r"""add_argument\(\s*["'](--[a-z0-9-]+)["']""", src))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef) and node.name in CLASSES:
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                        name = "--" + st.target.id.replace("_", "-")
                        flags |= {name, "--no-" + name[2:]}
    return flags


SERVER_ENGINES = [(path, e) for path in sorted(glob.glob("matrices/*.yaml")) if "root-discriminate" not in path
                  for e in load_matrix(path)["engines"] if e["engine"]["mode"] == "server"]


def test_the_flag_reader_finds_the_known_flags():
    f = vllm_flags()
    assert {"--model", "--speculative-config", "--compilation-config", "--language-model-only",
            "--gdn-prefill-backend", "--moe-backend", "--port", "--host", "--api-key"} <= f
    assert "--no-such-flag" not in f


@pytest.mark.parametrize("path,eng", SERVER_ENGINES, ids=[f"{p.split('/')[-1]}:{e['id']}" for p, e in SERVER_ENGINES])
def test_server_command_flags_exist_in_vllm(path, eng):
    spec = {"engine": eng["engine"], "runs": [r.__dict__ for r in eng["runs"]]}
    kw = engine_kwargs(spec, {"target": "/m/target", "draft": "/m/draft", "family": "hybrid"})
    if "speculative_config" in kw:
        kw["speculative_config"] = with_acceptance(kw["speculative_config"], eng["runs"][0].acceptance)
    cli = server_cli(kw, 18094, "dflash-lab-repro")
    unknown = sorted({a for a in cli if a.startswith("--")} - vllm_flags())
    assert not unknown, f"{path}:{eng['id']}: flags vLLM 0.22.1 does not define: {unknown}"
