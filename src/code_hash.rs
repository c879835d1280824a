/// FNV-1a (64-bit) of `bytes`: names the PTX a prebuilt module was made from (`ptx/cubins.txt`).
/// Shared by `build.rs` (which embeds a prebuilt module only for the PTX it was made from) and
/// `tests/ptx.rs` (which checks and regenerates the modules).
pub fn code_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
