"""Backend-specific kernels. Each module here registers, with
``npnorm.functional._dispatch.specialized``, faster implementations of generic
operations under the same signatures; tests compare them with the generic kernels."""
