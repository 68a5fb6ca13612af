"""The packages to build: `pipeline` and, from conf/ at the top of the checkout, its configs as `pipeline/conf/`.

Everything else about the project is in pyproject.toml. conf/ stays where a checkout's users and Hydra's
examples expect it; the wheel carries it inside the package, where `pipeline.config.compose.CONFIG_DIR` finds it.
"""

from pathlib import Path

from setuptools import find_packages, setup

CONF_PACKAGES = sorted(
    {
        ".".join(("pipeline", "conf", *p.parent.relative_to("conf").parts))
        for p in Path("conf").rglob("*.yaml")
    }
)

setup(
    packages=find_packages(include=["pipeline", "pipeline.*"]) + CONF_PACKAGES,
    package_dir={"pipeline.conf": "conf"},
    package_data={name: ["*.yaml"] for name in CONF_PACKAGES},
)
