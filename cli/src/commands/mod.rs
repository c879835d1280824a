//! Subcommands of the `oxccl` binary. Each module has an `Args` (clap) and a `run`.

pub mod bench;
pub mod demo;
// Linux only: process groups, PR_SET_PDEATHSIG and sigwait (oxccl's GPUs are on Linux).
#[cfg(target_os = "linux")]
pub mod launch;
pub mod plan;
pub mod plot;
pub mod reshard;
pub mod simulate;
pub mod tables;
pub mod verify;

/// What a subcommand reports on failure: a message for the user; the process exits non-zero.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

/// A run that found wrong results (a verification that failed, a benchmark's `#wrong`), as
/// opposed to input it refused or an error it met: the command exits with [`WrongResult::STATUS`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct WrongResult(pub String);

impl WrongResult {
    /// The exit status of a run that found wrong results (1: refused input or an error; 2: the
    /// parser's usage errors).
    pub const STATUS: u8 = 3;

    /// `WrongResult(why)` boxed as a subcommand's error.
    pub fn boxed(why: impl Into<String>) -> Box<dyn std::error::Error> {
        Box::new(WrongResult(why.into()))
    }
}

/// Element types, one vocabulary for every subcommand: the Rust names (`f32`, `bf16`, ...) and
/// nccl-tests' (`float`, `bfloat16`, ...). A subcommand refuses, by name, a type it cannot run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// 64-bit float (`double`).
    #[value(alias = "double", alias = "float64")]
    F64,
    /// 32-bit float (`float`).
    #[value(alias = "float", alias = "float32")]
    F32,
    /// 16-bit float, IEEE half (`half`).
    #[value(alias = "half", alias = "float16")]
    F16,
    /// bfloat16.
    #[value(alias = "bfloat16")]
    Bf16,
    /// FP8 E4M3.
    #[value(alias = "fp8_e4m3")]
    F8e4m3,
    /// FP8 E5M2.
    #[value(alias = "fp8_e5m2")]
    F8e5m2,
    /// 64-bit signed integer.
    #[value(alias = "int64")]
    I64,
    /// 32-bit signed integer.
    #[value(alias = "int32", alias = "int")]
    I32,
    /// 16-bit signed integer.
    #[value(alias = "int16")]
    I16,
    /// 8-bit signed integer.
    #[value(alias = "int8")]
    I8,
    /// 64-bit unsigned integer.
    #[value(alias = "uint64")]
    U64,
    /// 32-bit unsigned integer.
    #[value(alias = "uint32")]
    U32,
    /// 16-bit unsigned integer.
    #[value(alias = "uint16")]
    U16,
    /// 8-bit unsigned integer.
    #[value(alias = "uint8")]
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Self::F64 | Self::I64 | Self::U64 => 8,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F16 | Self::Bf16 | Self::I16 | Self::U16 => 2,
            Self::F8e4m3 | Self::F8e5m2 | Self::I8 | Self::U8 => 1,
        }
    }

    /// The name as given on the command line.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self).map_or_else(String::new, |v| v.get_name().to_owned())
    }

    /// The engine's type for this one, or a refusal naming those the GPU kernels move.
    pub fn device(self) -> Result<oxccl::DType, String> {
        oxccl::DType::ALL.iter().copied().find(|d| d.nccl_name() == self.nccl()).ok_or_else(|| {
            let names: Vec<String> =
                oxccl::DType::ALL.iter().filter_map(|d| Self::from_nccl(d.nccl_name())).map(Self::name).collect();
            format!("-d {}: the device kernels move {}", self.name(), names.join(", "))
        })
    }

    /// nccl-tests' name.
    fn nccl(self) -> &'static str {
        match self {
            Self::F64 => "double",
            Self::F32 => "float",
            Self::F16 => "half",
            Self::Bf16 => "bfloat16",
            Self::F8e4m3 => "fp8_e4m3",
            Self::F8e5m2 => "fp8_e5m2",
            Self::I64 => "int64",
            Self::I32 => "int32",
            Self::I16 => "int16",
            Self::I8 => "int8",
            Self::U64 => "uint64",
            Self::U32 => "uint32",
            Self::U16 => "uint16",
            Self::U8 => "uint8",
        }
    }

    fn from_nccl(name: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::value_variants().iter().copied().find(|d| d.nccl() == name)
    }
}

/// Reduction operators, by their nccl-tests names.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Sum.
    Sum,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Product.
    Prod,
    /// Average: the sum divided by the number of ranks.
    Avg,
}

impl From<Op> for oxccl::ReduceOp {
    fn from(op: Op) -> Self {
        match op {
            Op::Sum => oxccl::ReduceOp::Sum,
            Op::Min => oxccl::ReduceOp::Min,
            Op::Max => oxccl::ReduceOp::Max,
            Op::Prod => oxccl::ReduceOp::Prod,
            Op::Avg => oxccl::ReduceOp::Avg,
        }
    }
}
