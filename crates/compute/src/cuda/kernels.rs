//! Kernel registry: the `.cu` files of `crates/compute/kernels/` (built into the binary), each
//! prefixed with `common.cuh`, compiled by NVRTC to a cubin for the device's compute capability
//! and cached on disk (`nvrtc.rs`).
//!
//! The files whose kernels read affine scales and biases (`AFFINE_FILES`) have a build for each
//! other [`AffineParams`] (f16 scales and zero points, f32 scales and biases: common.cuh's
//! `aff_t`, `aff_scale`, `aff_bias` under `AFFINE_F16_ZERO` or `AFFINE_F32`), compiled and loaded
//! on first use, so that a model without such weights pays no NVRTC time for them; launchers of
//! affine kernels take their function from [`Kernels::affine`] or [`Kernels::for_format`].

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use rayon::prelude::*;

use super::ops::{AffineParams, WeightFormat};
use super::{driver_err, CudaError, Result};

const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One part of mma_vec.cu (its tail): the file with the part's two defines before it.
macro_rules! mma_vec {
    ($bits:literal, $rows:literal) => {
        concat!(
            "#define VEC_PART_BITS ",
            $bits,
            "\n#define VEC_PART_ROWS ",
            $rows,
            "\n",
            include_str!("../../kernels/mma_vec.cu")
        )
    };
}

/// (file name, source, kernels it defines).
const FILES: &[(&str, &str, &[&str])] = &[
    (
        "matvec.cu",
        include_str!("../../kernels/matvec.cu"),
        &["matvec_bf16", "matvec_swiglu_bf16"],
    ),
    (
        "matvec_rows.cu",
        include_str!("../../kernels/matvec_rows.cu"),
        &[
            "matvec_rows_bf16",
            "swiglu_rows_bf16",
            "matvec_rows_affine",
            "swiglu_rows_affine",
            "grouped_rows_bf16",
            "grouped_swiglu_bf16",
            "grouped_rows_affine",
            "grouped_swiglu_affine",
        ],
    ),
    (
        "mma_rows.cu",
        concat!(
            include_str!("../../kernels/mma_frag.cuh"),
            include_str!("../../kernels/mma_rows.cu")
        ),
        &[
            "mma_rows_bf16",
            "mma_rows_affine",
            "mma_swiglu_bf16",
            "mma_swiglu_affine",
            "mma_grouped_rows_bf16",
            "mma_grouped_swiglu_bf16",
            "mma_grouped_rows_affine",
            "mma_grouped_swiglu_affine",
            "mma_gemm_rows_bf16",
            "mma_gemm_rows_affine",
            "mma_gemm_swiglu_bf16",
            "mma_gemm_swiglu_affine",
            "mma_gsplit_rows_bf16_1",
            "mma_gsplit_swiglu_bf16_1",
            "mma_gsplit_rows_affine_1",
            "mma_gsplit_swiglu_affine_1",
            "mma_gsplit_rows_bf16_2",
            "mma_gsplit_swiglu_bf16_2",
            "mma_gsplit_rows_affine_2",
            "mma_gsplit_swiglu_affine_2",
            "mma_rows_affine_g16",
            "mma_swiglu_affine_g16",
            "mma_gemm_rows_affine_g16",
            "mma_gemm_swiglu_affine_g16",
            "mma_grouped_rows_affine_g16",
            "mma_grouped_swiglu_affine_g16",
            "mma_gsplit_rows_affine_1_g16",
            "mma_gsplit_swiglu_affine_1_g16",
            "mma_gsplit_rows_affine_2_g16",
            "mma_gsplit_swiglu_affine_2_g16",
        ],
    ),
    (
        "mma_wide.cu",
        concat!(
            include_str!("../../kernels/mma_frag.cuh"),
            include_str!("../../kernels/mma_wide.cu")
        ),
        &super::wide::ENTRIES,
    ),
    ("mma_vec_4.cu", mma_vec!(4, 0), super::vec::PARTS[0]),
    ("mma_vec_rows_4.cu", mma_vec!(4, 1), super::vec::PARTS[1]),
    ("mma_vec_8.cu", mma_vec!(8, 0), super::vec::PARTS[2]),
    ("mma_vec_rows_8.cu", mma_vec!(8, 1), super::vec::PARTS[3]),
    ("mma_vec_g16.cu", mma_vec!(16, 0), super::vec::PARTS[4]),
    ("mma_vec_rows_g16.cu", mma_vec!(16, 1), super::vec::PARTS[5]),
    (
        "norm.cu",
        include_str!("../../kernels/norm.cu"),
        &["add_rmsnorm"],
    ),
    (
        "gdn.cu",
        include_str!("../../kernels/gdn.cu"),
        &[
            "gdn_conv_step",
            "gdn_step",
            "gdn_step128",
            "gdn_conv_verify",
            "gdn_verify",
            "gdn_verify128",
            "gdn_restore",
        ],
    ),
    (
        "attention.cu",
        include_str!("../../kernels/attention.cu"),
        &["attn_prep", "attn_partial", "attn_combine"],
    ),
    (
        "moe.cu",
        include_str!("../../kernels/moe.cu"),
        &[
            "router_topk",
            "moe_combine",
            "moe_combine_norm",
            "host_experts_publish",
            "host_experts_wait",
        ],
    ),
    (
        "sample.cu",
        include_str!("../../kernels/sample.cu"),
        &["sample_advance"],
    ),
    (
        "embed.cu",
        include_str!("../../kernels/embed.cu"),
        &["embed_bf16", "embed_affine"],
    ),
    (
        "fill.cu",
        include_str!("../../kernels/fill.cu"),
        &[
            "fill_uniform_bf16",
            "fill_uniform_f16",
            "fill_uniform_f32",
            "fill_random_u32",
            "fill_random_fp8",
        ],
    ),
    (
        "gdn_chunk.cu",
        include_str!("../../kernels/gdn_chunk.cu"),
        &["gdn_chunk_prep", "gdn_chunk_state32", "gdn_chunk_state64"],
    ),
    (
        "prefill.cu",
        include_str!("../../kernels/prefill.cu"),
        &[
            "gdn_conv_rows",
            "gdn_conv_state",
            "gdn_pack",
            "gated_rmsnorm_rows",
            "gdn_rec_rows",
            "moe_group",
        ],
    ),
    (
        "gemm.cu",
        include_str!("../../kernels/gemm.cu"),
        &[
            "rows_to_bf16",
            "rows_to_bf16_v4",
            "dequant_affine_bf16",
            "swiglu_rows",
            "moe_gemm_bf16",
            "moe_gemm_bf16_swiglu",
            "moe_gemm_affine4",
            "moe_gemm_affine4_swiglu",
            "moe_gemm_affine8",
            "moe_gemm_affine8_swiglu",
            "dequant_fp8_bf16",
            "moe_gemm_fp8",
            "moe_gemm_fp8_swiglu",
        ],
    ),
    (
        "flash_prefill.cu",
        include_str!("../../kernels/flash_prefill.cu"),
        &[
            "flash_prefill_64",
            "flash_prefill_128",
            "flash_prefill_256",
            "flash_prefill_64_bf16",
            "flash_prefill_128_bf16",
            "flash_prefill_256_bf16",
        ],
    ),
    (
        "fp8.cu",
        include_str!("../../kernels/fp8.cu"),
        &[
            "matvec_rows_fp8",
            "swiglu_rows_fp8",
            "grouped_rows_fp8",
            "grouped_swiglu_fp8",
            "matvec_fp8",
            "matvec_swiglu_fp8",
        ],
    ),
    (
        "qmatvec.cu",
        include_str!("../../kernels/qmatvec.cu"),
        &[
            "matvec_affine2_r2",
            "matvec_affine4_r2",
            "matvec_affine8_r2",
            "matvec_affine2_r4",
            "matvec_affine4_r4",
            "matvec_affine8_r4",
            "matvec_swiglu_affine2_r2",
            "matvec_swiglu_affine4_r2",
            "matvec_swiglu_affine8_r2",
            "matvec_swiglu_affine2_r4",
            "matvec_swiglu_affine4_r4",
            "matvec_swiglu_affine8_r4",
            "matvec_affine2_r2_far",
            "matvec_affine4_r2_far",
            "matvec_affine8_r2_far",
            "matvec_swiglu_affine2_r2_far",
            "matvec_swiglu_affine4_r2_far",
            "matvec_swiglu_affine8_r2_far",
            "moe_down_combine_affine2",
            "moe_down_combine_affine4",
            "moe_down_combine_affine8",
            "moe_down_combine_affine4_r8",
            "moe_down_combine_affine8_r8",
        ],
    ),
];

/// The files with a build for each [`AffineParams`]: every file whose kernels read affine scales
/// and biases. Their entry points with `affine` in the name are those builds'.
const AFFINE_FILES: [&str; 12] = [
    "qmatvec.cu",
    "matvec_rows.cu",
    "mma_rows.cu",
    "mma_wide.cu",
    "mma_vec_4.cu",
    "mma_vec_rows_4.cu",
    "mma_vec_8.cu",
    "mma_vec_rows_8.cu",
    "mma_vec_g16.cu",
    "mma_vec_rows_g16.cu",
    "gemm.cu",
    "embed.cu",
];

/// The suffix of the entry points for 8-bit codes in groups of 16, which only the f32-parameter
/// build has (mma_frag.cuh): [`Kernels::for_format`] takes them for such weights.
const G16: &str = "_g16";

/// Which build of the kernel files: the default one (MLX's bf16 parameters), or the affine
/// kernels' build for other [`AffineParams`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    Default,
    Affine(AffineParams),
}

/// The builds [`compile_all`] checks.
const BUILDS: [Build; 3] = [
    Build::Default,
    Build::Affine(AffineParams::F16Zero),
    Build::Affine(AffineParams::F32),
];

impl Build {
    /// The files of this build, with the names of theirs it loads (a file with none, such as
    /// mma_vec.cu's `_g16` parts outside the f32-parameter build, is not compiled).
    fn files(self) -> impl Iterator<Item = (&'static str, &'static str, Vec<&'static str>)> {
        FILES.iter().filter_map(move |&(file, src, names)| {
            let g16 = self == Build::Affine(AffineParams::F32);
            let names = names
                .iter()
                .copied()
                .filter(move |n| g16 || !n.ends_with(G16));
            let names: Vec<_> = match self {
                Build::Default => names.collect(),
                Build::Affine(_) if AFFINE_FILES.contains(&file) => {
                    names.filter(|n| n.contains("affine")).collect()
                }
                Build::Affine(_) => return None,
            };
            (!names.is_empty()).then_some((file, src, names))
        })
    }

    /// NVRTC options beyond the common ones (common.cuh's `aff_t`).
    fn defines(self) -> &'static [&'static str] {
        match self {
            Build::Default | Build::Affine(AffineParams::Bf16) => &[],
            Build::Affine(AffineParams::F16Zero) => &["-DAFFINE_F16_ZERO"],
            Build::Affine(AffineParams::F32) => &["-DAFFINE_F32"],
        }
    }
}

/// Compiled kernels by name.
pub struct Kernels {
    funcs: HashMap<&'static str, CudaFunction>,
    /// The affine kernels' builds for [`AffineParams::F16Zero`] and [`AffineParams::F32`], each
    /// once compiled and loaded.
    f16_zero: OnceLock<HashMap<&'static str, CudaFunction>>,
    f32: OnceLock<HashMap<&'static str, CudaFunction>>,
    ctx: Arc<CudaContext>,
    arch: &'static str,
}

/// The cubin of one file of `build` for `arch` (see `nvrtc.rs`).
fn cubin_for(file: &str, src: &str, arch: &str, build: Build) -> Result<Vec<u8>> {
    super::nvrtc::cubin(file, &format!("{COMMON}\n{src}"), arch, build.defines())
}

/// NVRTC's real architecture name for a compute capability.
fn arch_name(cc: (i32, i32)) -> Result<&'static str> {
    Ok(match cc {
        (9, 0) => "sm_90",
        (8, 9) => "sm_89",
        (8, 6) => "sm_86",
        (8, 0) => "sm_80",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (major, minor) => {
            return Err(CudaError::Unsupported(format!(
                "compute capability {major}.{minor} is not supported (supported: 8.0, 8.6, 8.9, 9.0, 10.0, 12.0)"
            )))
        }
    })
}

/// Compile every kernel file for `arch` (e.g. `sm_90`) without a device, every build: a check
/// that needs only NVRTC.
pub fn compile_all(arch: &'static str) -> Result<()> {
    let jobs: Vec<_> = BUILDS
        .into_iter()
        .flat_map(|b| b.files().map(move |f| (b, f)))
        .collect();
    jobs.par_iter()
        .try_for_each(|(build, (file, src, _))| cubin_for(file, src, arch, *build).map(|_| ()))
}

/// The kernels of `build` for `arch`, loaded into `ctx`.
fn load_build(
    ctx: &Arc<CudaContext>,
    arch: &'static str,
    build: Build,
) -> Result<HashMap<&'static str, CudaFunction>> {
    // NVRTC compiles the files in parallel (the first start on a machine); loading a cubin
    // takes no assembly.
    let files: Vec<_> = build.files().collect();
    let images = files
        .par_iter()
        .map(|(file, src, _)| cubin_for(file, src, arch, build))
        .collect::<Result<Vec<_>>>()?;
    let mut funcs = HashMap::new();
    for ((file, _, names), image) in files.into_iter().zip(images) {
        let module = ctx
            .load_module(Ptx::from_binary(image))
            .map_err(driver_err(file))?;
        for name in names {
            let f = module.load_function(name).map_err(driver_err(name))?;
            funcs.insert(name, f);
        }
    }
    Ok(funcs)
}

impl Kernels {
    pub(super) fn load(ctx: &Arc<CudaContext>, cc: (i32, i32)) -> Result<Kernels> {
        let arch = arch_name(cc)?;
        Ok(Kernels {
            funcs: load_build(ctx, arch, Build::Default)?,
            f16_zero: OnceLock::new(),
            f32: OnceLock::new(),
            ctx: ctx.clone(),
            arch,
        })
    }

    /// The kernel `name` (a name listed in `FILES`; anything else is a bug in this crate), of
    /// the default build: for affine kernels, the one for MLX's bf16 parameters.
    pub fn get(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// The affine kernel `name` built for `params`: [`Kernels::get`]'s for
    /// [`AffineParams::Bf16`]; for the others that build's, compiled and loaded the first time any
    /// of it is asked for (an NVRTC or driver failure is returned, and tried again on the next
    /// call). `name` is an entry point of `AFFINE_FILES` with `affine` in its name; anything else
    /// is a bug in this crate.
    pub fn affine(&self, name: &str, params: AffineParams) -> Result<&CudaFunction> {
        match params {
            AffineParams::Bf16 => Ok(self.get(name)),
            _ => Ok(&self.build(params)?[name]),
        }
    }

    /// The kernel `name` for weights stored as `format`: [`Kernels::affine`] with the format's
    /// parameters for affine weights (for 8-bit codes in groups of 16 with f32 parameters, the
    /// entry `name` + `_g16` where there is one), else [`Kernels::get`].
    pub fn for_format(&self, name: &str, format: &WeightFormat) -> Result<&CudaFunction> {
        match *format {
            _ if format.group16() => {
                let funcs = self.build(AffineParams::F32)?;
                Ok(funcs
                    .get(format!("{name}{G16}").as_str())
                    .unwrap_or(&funcs[name]))
            }
            WeightFormat::Affine { params, .. } => self.affine(name, params),
            WeightFormat::Bf16 | WeightFormat::Fp8 { .. } => Ok(self.get(name)),
        }
    }

    /// Compile and load the build of the affine kernels for `params` now, if it is not loaded
    /// yet: a model holding such weights calls it at upload, so that a failure surfaces there and
    /// no compilation happens later (in a captured decode step, say).
    pub fn prepare(&self, params: AffineParams) -> Result<()> {
        match params {
            AffineParams::Bf16 => Ok(()),
            _ => self.build(params).map(|_| ()),
        }
    }

    /// The affine kernels' build for `params` (not [`AffineParams::Bf16`], the default build's),
    /// loaded on first use.
    fn build(&self, params: AffineParams) -> Result<&HashMap<&'static str, CudaFunction>> {
        let cell = match params {
            AffineParams::F32 => &self.f32,
            _ => &self.f16_zero,
        };
        if let Some(funcs) = cell.get() {
            return Ok(funcs);
        }
        let funcs = load_build(&self.ctx, self.arch, Build::Affine(params))?;
        Ok(cell.get_or_init(|| funcs))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn affine_rows_per_warp_grows_with_rows() {
        use super::super::ops::affine_rows_per_warp;
        assert_eq!(affine_rows_per_warp(8 * 1024), 2);
        assert_eq!(affine_rows_per_warp(248_320), 4);
    }

    #[test]
    fn limits_the_launchers_assume_are_the_kernels_own() {
        use super::super::gdn::GDN_ROW_GROUPS;
        use super::super::ops::{
            swiglu_warps_per_block, GDN_CONV_KMAX, GDN_DK_MAX, GDN_DV_MAX, GDN_VERIFY_MAX,
        };
        let file = |name: &str| super::FILES.iter().find(|f| f.0 == name).unwrap().1;
        let (gdn, qmv, attn) = (file("gdn.cu"), file("qmatvec.cu"), file("attention.cu"));
        let sample = file("sample.cu");
        use super::super::attention as at;
        use super::super::wide;
        for (src, name, value) in [
            (super::COMMON, "CONV_KMAX", GDN_CONV_KMAX as u32),
            (
                qmv,
                "QMV_SWIGLU_R2_THREADS",
                32 * swiglu_warps_per_block(2, false),
            ),
            (gdn, "GDN_DK_MAX", GDN_DK_MAX as u32),
            (gdn, "GDN_DV_MAX", GDN_DV_MAX as u32),
            (gdn, "GDN_ROW_GROUPS", GDN_ROW_GROUPS),
            (gdn, "GDN_VERIFY_MAX", GDN_VERIFY_MAX as u32),
            (qmv, "DOWN_ROWS", super::super::moe::DOWN_ROWS as u32),
            (
                qmv,
                "DOWN_ROWS_WIDE",
                super::super::moe::DOWN_ROWS_WIDE as u32,
            ),
            (attn, "ATTN_DMAX", at::ATTN_DMAX as u32),
            (attn, "ATTN_MAX_SPLITS", at::ATTN_MAX_SPLITS as u32),
            (attn, "ATTN_GQA", at::ATTN_GQA as u32),
            (attn, "ATTN_POS", at::ATTN_POS as u32),
            (attn, "ATTN_STAGES", at::ATTN_STAGES as u32),
            (
                sample,
                "SAMPLE_WORDS",
                super::super::ops::SampleParams::WORDS as u32,
            ),
            (file("mma_wide.cu"), "WIDE_STAGES", wide::WIDE_STAGES as u32),
            (
                file("mma_wide.cu"),
                "WIDE_ROWB",
                super::super::dispatch::WIDE_ROWB as u32,
            ),
            (file("mma_wide.cu"), "WIDE_WLD", wide::WIDE_WLD as u32),
            (file("mma_wide.cu"), "WIDE_SBB", wide::WIDE_SBB as u32),
        ] {
            let line = format!("#define {name} {value}\n");
            assert!(
                src.contains(&line),
                "the kernels define {name} otherwise than {value}"
            );
        }
    }

    #[test]
    fn near_one_row_swiglu_takes_blocks_of_4_warps() {
        use super::super::ops::swiglu_warps_per_block;
        assert_eq!(swiglu_warps_per_block(2, false), 4);
        assert_eq!(swiglu_warps_per_block(2, true), 8);
        assert_eq!(swiglu_warps_per_block(4, false), 8);
    }

    #[test]
    fn gdn_step_takes_a_cluster_of_32_column_blocks_per_head_on_hopper() {
        use super::super::gdn::gdn_step_split;
        assert_eq!(gdn_step_split(128, true), (4, 32));
        assert_eq!(gdn_step_split(100, true), (4, 32));
        assert_eq!(gdn_step_split(32, true), (1, 32));
        assert_eq!(gdn_step_split(128, false), (1, 128));
        assert_eq!(gdn_step_split(40, false), (1, 64));
        use super::super::gdn::gdn_step_kernel;
        assert_eq!(gdn_step_kernel(128, 128, 32), "gdn_step128");
        assert_eq!(gdn_step_kernel(128, 128, 128), "gdn_step");
        assert_eq!(gdn_step_kernel(64, 128, 32), "gdn_step");
    }

    /// The names of `build`'s kernels.
    fn names_of(build: super::Build) -> Vec<&'static str> {
        build.files().flat_map(|f| f.2).collect()
    }

    /// Every affine entry of the tensor-core files that can take 8-bit codes (mma_rows.cu,
    /// mma_wide.cu, mma_vec.cu's 8-bit ones) has a `_g16` twin: `Kernels::for_format` falls back
    /// to the plain entry, which reads groups of whole 32-wide chunks, when there is none.
    #[test]
    fn tensor_core_affine_entries_have_group_16_twins() {
        let f32 = names_of(super::Build::Affine(super::AffineParams::F32));
        for (file, _, names) in super::FILES {
            let vec = file.starts_with("mma_vec");
            if !vec && !["mma_rows.cu", "mma_wide.cu"].contains(file) {
                continue;
            }
            let affine = if vec { "affine8" } else { "affine" };
            let plain = names.iter().filter(|n| !n.ends_with(super::G16));
            for n in plain.filter(|n| n.contains(affine)) {
                let twin = format!("{n}{}", super::G16);
                assert!(f32.contains(&twin.as_str()), "{file}: {n} has no {twin}");
            }
        }
    }

    #[test]
    fn every_affine_entry_point_is_registered() {
        let registered = names_of(super::Build::Default);
        let f16_zero = names_of(super::Build::Affine(super::AffineParams::F16Zero));
        for swiglu in [false, true] {
            for bits in [2, 4, 8] {
                for rows in [2, 4] {
                    for far in [false, true] {
                        let name = super::super::ops::affine_kernel(swiglu, bits, rows, far);
                        assert!(registered.contains(&name), "{name}");
                        assert!(f16_zero.contains(&name), "{name} (f16 zero points)");
                    }
                }
            }
        }
    }

    /// The other parameters' builds hold every affine kernel, and every file whose kernels read
    /// affine parameters through common.cuh's aff_scale has those builds, and no other does;
    /// those files read no scale or bias as bf16 themselves.
    #[test]
    fn every_affine_kernel_has_the_other_parameters_builds() {
        let mut want: Vec<&str> = names_of(super::Build::Default)
            .into_iter()
            .filter(|n| n.contains("affine"))
            .collect();
        want.sort_unstable();
        for build in &super::BUILDS[1..] {
            let mut got = names_of(*build);
            got.sort_unstable();
            // The f32 build's entries for groups of 16 each stand beside an entry of every build.
            let f32 = *build == super::Build::Affine(super::AffineParams::F32);
            for n in got.iter().filter(|n| n.ends_with(super::G16)) {
                assert!(f32, "{n} outside the f32 build");
                assert!(want.contains(&&n[..n.len() - super::G16.len()]), "{n}");
            }
            got.retain(|n| !n.ends_with(super::G16));
            assert_eq!(got, want, "{build:?}");
        }
        const BF16_READS: [&str; 10] = [
            "bf16f(S[",
            "bf16f(B[",
            "bf16f(Bs[",
            "bf16f(sc[",
            "bf16f(bi[",
            "bf16f(ps[",
            "bf16f(pb[",
            "bf16f(row[",
            "splat_bf16(S",
            "bf16_t* __restrict__ S",
        ];
        for (file, src, _) in super::FILES {
            let reads = src.contains("aff_scale(");
            assert_eq!(
                reads,
                super::AFFINE_FILES.contains(file),
                "{file}: reads affine parameters through aff_scale: {reads}"
            );
            if reads {
                for p in BF16_READS {
                    assert!(!src.contains(p), "{file} reads a parameter as bf16: {p}");
                }
            }
        }
    }

    /// Every entry point a file defines is in its list (entry points whose names a macro builds
    /// are left to the launchers' test below).
    #[test]
    fn every_entry_point_of_a_file_is_registered() {
        const MARK: &str = "extern \"C\" __global__ void";
        for (file, src, names) in super::FILES {
            // Lines of a macro (ending in a backslash) build their names from its parameters.
            let lines: Vec<&str> = src.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let Some(at) = line.find(MARK).filter(|_| !line.ends_with('\\')) else {
                    continue;
                };
                let text = format!(
                    "{} {}",
                    &line[at + MARK.len()..],
                    lines.get(i + 1).unwrap_or(&"")
                );
                let mut rest = text.trim_start();
                for attr in ["__launch_bounds__(", "__maxnreg__("] {
                    if let Some(after) = rest.strip_prefix(attr) {
                        rest = after[after.find(')').unwrap() + 1..].trim_start();
                    }
                }
                let name = rest[..rest.find('(').unwrap()].trim();
                assert!(names.contains(&name), "{file}: {name} is not registered");
            }
        }
    }

    /// Kernels launched by a literal name are registered; affine ones (but the MLX-only
    /// embedding) are taken through `Kernels::affine`, so that weights with f16 zero points get
    /// their build.
    #[test]
    fn every_kernel_the_launchers_use_is_registered() {
        let launchers = [
            include_str!("ops.rs"),
            include_str!("attention.rs"),
            include_str!("gdn_chunk.rs"),
            include_str!("prefill.rs"),
            include_str!("gemm.rs"),
            include_str!("moe.rs"),
            include_str!("vec.rs"),
            include_str!("wide.rs"),
        ];
        let registered = names_of(super::Build::Default);
        let f16_zero = names_of(super::Build::Affine(super::AffineParams::F16Zero));
        let literals = |call: &'static str| {
            launchers.into_iter().flat_map(move |src| {
                src.split(call)
                    .skip(1)
                    .map(|part| &part[..part.find('"').unwrap()])
            })
        };
        for name in literals("kernels().get(\"") {
            assert!(
                registered.contains(&name),
                "kernel {name} is launched but not registered"
            );
            assert!(
                !f16_zero.contains(&name),
                "affine kernel {name} is launched without its parameters' build"
            );
        }
        for name in literals("kernels().affine(\"") {
            assert!(
                f16_zero.contains(&name),
                "kernel {name} is launched as affine but has no f16-zero-point build"
            );
        }
    }

    /// Read-only `const T* __restrict__` parameters take the non-coherent path, whose loads
    /// ptxas may move ahead of griddepcontrol.wait (common.cuh, pdl_entry): only data no kernel
    /// of a step writes may come through them. Every such parameter must be one of these names:
    /// weights (matrix words, scales, biases, norm and conv weights, the decay parameters, the
    /// embedding table, RoPE frequencies) and what the host writes between steps (slots,
    /// positions, tokens, expert locations, the host split table). A new one is either added here
    /// with a reason or made a plain pointer.
    #[test]
    fn read_only_kernel_parameters_are_weights_or_host_tables() {
        #[rustfmt::skip]
        const ALLOWED: &[&str] = &[
            "W", "S", "B", "Bs", "Wf", "Sf", "Bf", "bias", "w", "scale", "qn", "kn", "norm_w",
            "neg_a", "dt_bias", "table", "words", "sc", "bi", "row", "inv_freq",
            "slots", "pos_arr", "tok", "loc", "host_take",
        ];
        let mut found = Vec::new();
        for (file, src, _) in super::FILES
            .iter()
            .chain([&("common.cuh", super::COMMON, &[][..])])
        {
            for (at, _) in src.match_indices("__restrict__") {
                let decl_start = src[..at].rfind([',', '(']).map_or(0, |p| p + 1);
                if !src[decl_start..at].trim_start().starts_with("const") {
                    continue;
                }
                let name: String = src[at + "__restrict__".len()..]
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !ALLOWED.contains(&name.as_str()) {
                    found.push(format!("{file}: {name}"));
                }
            }
        }
        assert!(
            found.is_empty(),
            "read-only parameters that may be activations: {found:?}"
        );
    }
}
