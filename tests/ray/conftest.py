"""One local Ray instance for every test in this folder (all marked ``e2e``).

Started once per session on loopback (``_node_ip_address="127.0.0.1"``: Ray
would otherwise pick this machine's other address), with two CPUs, a capped
object store and no dashboard; the ranks and replicas ask for fractional
CPUs so several fit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine"))  # lora_files

#: what every Ray worker of these tests needs: gloo on loopback, the test plugins
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the ray extra is part of the test install")
    from diffrt.serve.ray_patience import lengthen_proxy_checks

    lengthen_proxy_checks()  # as diffrt serve does: Serve's proxy starts slowly when busy
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             object_store_memory=256 << 20, log_to_driver=False,
             runtime_env={"env_vars": LOOPBACK_ENV})
    try:
        yield ray
    finally:
        ray.shutdown()
