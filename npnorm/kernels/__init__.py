"""Faster kernel families for NumPy input, behind the generic kernels' signatures.

``numpy_fast`` and ``numpy_fast_channels`` (with ``_blocks``) are the ``"numpy"`` family;
``numba_rows`` and ``numba_channels`` (with ``_staging`` and the compiled loops in
``_numba_loops``) the ``"numba"`` family. Each registers its kernels with
``npnorm.functional._dispatch.specialized`` and is imported the first time its family is
used; the tests compare every kernel with the generic (reference) one."""
