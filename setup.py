"""The C extension only (everything else is in pyproject.toml): the hot loops, optional, so an
install without a C compiler still succeeds and runs the pure-Python twin
(derecho_async/hotpath.py says which one runs)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "derecho_async._native",
            sources=[
                "native/module.c",
                "native/words.c",
                "native/ordering.c",
                "native/slotring.c",
                "native/shmring.c",
                "native/plaincall.c",
                "native/dispatch.c",
                "native/bytescopy.c",
                "native/logframe.c",
                "native/beacon.c",
            ],
            depends=["native/native.h"],
            optional=True,
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-unused-parameter"],
        )
    ]
)
