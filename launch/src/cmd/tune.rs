//! `flowprefill tune`: the attention autotuner ahead of time. On the GPU `--device` names, every
//! configuration of the tensor-core attention (and, for decode-like calls, the key split's
//! blocks per SM) is timed with CUDA events on a causal prefill of `--tokens` tokens, on a
//! narrow one (as many blocks as the GPU has SMs) and on one decode step over `--tokens`, per
//! head dimension; the winners go to the decisions file
//! (`$FLOWPREFILL_HOME/tune/attention.tsv`), where every later process on this machine finds
//! them (`flowprefill devices` lists them). Without this command the same happens on the first
//! large attention of a job; `FLOWPREFILL_TUNE=off` turns that off, `FLOWPREFILL_FLASH_KERNEL`
//! fixes the kernel.

use anyhow::Result;

/// Arguments of `flowprefill tune`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Head dimensions to tune, with the query and KV heads to time them with:
    /// `DIM:HEADS/KV_HEADS`, comma-separated (the defaults: SmolLM2's and the 8B shape's).
    #[arg(long, default_value = "64:9/3,128:32/8")]
    pub shapes: String,
    /// Tokens of the timed prefill (and context of the timed decode step).
    #[arg(long, default_value_t = 8192)]
    pub tokens: u32,
    /// Print the launch-shape header of configuration N (the `#define`s flowprefill puts before
    /// every kernel source) and exit: for building the `.cu` files with nvcc outside
    /// flowprefill (scripts/flash-tune). Needs no GPU.
    #[arg(long, value_name = "N")]
    pub header: Option<usize>,
}

/// One `DIM:HEADS/KV_HEADS`.
pub fn parse_shape(s: &str) -> Result<(u32, u32, u32)> {
    let bad = || anyhow::anyhow!("--shapes `{s}`: expected DIM:HEADS/KV_HEADS, e.g. 128:32/8");
    let (d, heads) = s.trim().split_once(':').ok_or_else(bad)?;
    let (h, kv) = heads.split_once('/').ok_or_else(bad)?;
    let n = |x: &str| x.trim().parse::<u32>().map_err(|_| bad());
    let (d, h, kv) = (n(d)?, n(h)?, n(kv)?);
    anyhow::ensure!(d == 64 || d == 128, "--shapes `{s}`: the tensor-core attention takes head dimension 64 or 128");
    anyhow::ensure!(kv > 0 && h % kv == 0, "--shapes `{s}`: query heads must be a multiple of KV heads");
    Ok((d, h, kv))
}

/// Runs `flowprefill tune`.
pub fn run(common: &crate::Common, args: Args) -> Result<()> {
    if let Some(c) = args.header {
        let n = flowprefill_kernels::gpu::shapes::FA2_CONFIGS.len();
        anyhow::ensure!(c < n, "--header {c}: the configurations are 0 to {}", n - 1);
        print!("{}", flowprefill_kernels::gpu::shapes::header(c));
        return Ok(());
    }
    let shapes = args.shapes.split(',').map(parse_shape).collect::<Result<Vec<_>>>()?;
    anyhow::ensure!(args.tokens >= 256, "--tokens {}: time at least 256 tokens", args.tokens);
    tune_on(common, &shapes, args.tokens)
}

#[cfg(feature = "cuda")]
fn tune_on(common: &crate::Common, shapes: &[(u32, u32, u32)], tokens: u32) -> Result<()> {
    use flowprefill_kernels::{DType, DeviceSpec};
    let gpus = flowprefill_kernels::cuda::devices()?.len();
    let spec = match common.device {
        DeviceSpec::Cpu => DeviceSpec::CudaLocal.resolve(gpus),
        other => other.resolve(gpus),
    };
    let DeviceSpec::Cuda(ordinal) = spec else { anyhow::bail!("flowprefill tune needs a GPU (--device cuda:N)") };
    let backend = flowprefill_kernels::cuda::CudaBackend::new(ordinal, common.weights, DType::Bf16)?;
    println!(
        "cuda:{ordinal} ({}): timing {} configuration(s) of the attention",
        backend.arch(),
        flowprefill_kernels::gpu::shapes::FA2_CONFIGS.len()
    );
    for &(d, h, kv) in shapes {
        for e in backend.tune_synthetic(d, h, kv, tokens)? {
            let cands: Vec<String> = e.candidates.iter().map(|(c, b, us)| format!("c{c}/{b}: {us:.1} us")).collect();
            println!(
                "d{d} {} ({} x {} tokens, {h}/{kv} heads): configuration {} ({}), {} block(s) per SM  [{}]",
                e.key.class,
                e.timed_on.0,
                e.timed_on.1,
                e.config,
                flowprefill_kernels::gpu::tune::describe_config(e.config as usize, d),
                e.blocks_per_sm,
                cands.join(", ")
            );
        }
    }
    for o in backend.occupancy().iter().filter(|o| o.kernel.contains("flash")) {
        println!("occupancy: {o}");
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn tune_on(_: &crate::Common, _: &[(u32, u32, u32)], _: u32) -> Result<()> {
    anyhow::bail!("flowprefill tune times GPU kernels: rebuild with `cargo build --release --features cuda`")
}

#[cfg(test)]
mod tests {
    #[test]
    fn shapes_parse_or_say_what_to_write() {
        assert_eq!(super::parse_shape("128:32/8").unwrap(), (128, 32, 8));
        assert_eq!(super::parse_shape(" 64:9/3").unwrap(), (64, 9, 3));
        assert!(super::parse_shape("96:8/8").unwrap_err().to_string().contains("64 or 128"));
        assert!(super::parse_shape("128:30/8").unwrap_err().to_string().contains("multiple"));
        assert!(super::parse_shape("128").unwrap_err().to_string().contains("DIM:HEADS/KV_HEADS"));
    }
}
