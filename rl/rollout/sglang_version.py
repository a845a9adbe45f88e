"""The one place the pinned SGLang release is named.

The Makefile, docker/Dockerfile, the docs and the tests read it from here (the Dockerfile and
the Makefile with ``sed`` on the line below, so keep it a single plain assignment)."""

SGLANG_VERSION = "0.5.23"
