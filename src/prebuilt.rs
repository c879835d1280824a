// The prebuilt modules and their manifest, `ptx/cubins.txt`: shared by `build.rs` (which embeds a
// module's machine code only where the manifest vouches for it) and the crate (`oxccl::ptx`, which
// `tests/ptx.rs` uses to check and remake the code). Included as source by both.

/// The modules that ship prebuilt: (PTX file, machine-code file), both under `ptx/`.
pub const PREBUILT: &[(&str, &str)] =
    &[("oxccl_kernels.ptx", "oxccl_kernels.sm_90a.cubin")];

/// FNV-1a (64-bit) of `bytes`, as `ptx/cubins.txt` records it (16 hex digits).
pub fn code_hash(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{h:016x}")
}

/// One line of `ptx/cubins.txt`: `PTX-HASH PTX CODE CODE-HASH PTXAS-VERSION…`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestEntry {
    /// [`code_hash`] of the PTX the code was made from.
    pub ptx_hash: String,
    /// File name of the PTX, under `ptx/` (as in [`PREBUILT`]).
    pub ptx: String,
    /// File name of the machine code made from it, under `ptx/`.
    pub code: String,
    /// [`code_hash`] of the machine code.
    pub code_hash: String,
    /// The last line of `ptxas --version` of the `ptxas` that made it.
    pub ptxas: String,
}

impl ManifestEntry {
    /// The manifest line.
    pub fn line(&self) -> String {
        format!("{} {} {} {} {}", self.ptx_hash, self.ptx, self.code, self.code_hash, self.ptxas)
    }
}

/// The entry for `ptx` in the manifest text, if any (`#` lines are comments).
pub fn manifest_entry(manifest: &str, ptx: &str) -> Option<ManifestEntry> {
    manifest.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let f: Vec<&str> = l.splitn(5, ' ').collect();
        (f.len() == 5 && f[1] == ptx).then(|| ManifestEntry {
            ptx_hash: f[0].to_string(),
            ptx: f[1].to_string(),
            code: f[2].to_string(),
            code_hash: f[3].to_string(),
            ptxas: f[4].trim().to_string(),
        })
    })
}

/// Whether `code` may be embedded beside `ptx_text` (the PTX a build embeds as `ptx`): `Ok` if the
/// manifest records both that PTX's hash and the code's, else why not.
pub fn vouched(manifest: &str, ptx: &str, ptx_text: &[u8], code: &[u8]) -> Result<(), String> {
    let e = manifest_entry(manifest, ptx).ok_or_else(|| format!("ptx/cubins.txt has no line for {ptx}"))?;
    if e.ptx_hash != code_hash(ptx_text) {
        return Err(format!("{} was made from other PTX than this build's {ptx}", e.code));
    }
    if e.code_hash != code_hash(code) {
        return Err(format!("ptx/{} is not the code ptx/cubins.txt records", e.code));
    }
    Ok(())
}
