//! Host/device ABI.
