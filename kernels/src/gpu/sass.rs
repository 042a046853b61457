//! SASS, the GPU's machine code, read statically: the static performance gate's half that
//! needs no GPU and no CUDA library. `nvdisasm` (PyPI `nvidia-cuda-nvdisasm`, installed by
//! `scripts/cuda-wheels.sh nvdisasm`) turns a CUBIN from NVRTC into text; [`parse`] reads that
//! text into functions of instructions, [`loops`] finds the loops (a branch back to a label at
//! or before it), and [`Row::of`] makes the gate's row of one kernel: local-memory
//! instructions anywhere, and for an attention kernel its steady-state loop (the innermost loop
//! that holds tensor-core instructions; of several, the one with the fewest instructions per
//! HMMA: the loop full tiles take) with its instruction mix. [`Row::check`] holds a row to the
//! kernel's [`SassBudget`].
//!
//! Everything here fails loudly: text with no function, a function without instructions, an
//! instruction line it cannot read, or an attention kernel without a tensor-core loop is an
//! error, never an empty row that passes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What the static gate asks of one kernel's SASS, beyond "no local memory" (asked of all).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SassBudget {
    /// No tensor-core loop expected (elementwise, norms, ...).
    Plain,
    /// A tensor-core loop must be found and is reported; no budget on its mix (the slow
    /// reference kernels).
    Reported,
    /// A tensor-core loop must be found, with at most `max_per_hmma` instructions per HMMA in
    /// its static body and at least `min_hmma_per_ldsm` HMMA per LDSM.
    Loop {
        /// Instructions of the loop body per HMMA, at most.
        max_per_hmma: f64,
        /// HMMA per LDSM in the loop body, at least.
        min_hmma_per_ldsm: f64,
    },
    /// Hopper's warpgroup products: at least `hgmma` HGMMA in the function and no HMMA (no
    /// product fell back to `mma.sync`); with `in_loop`, a loop holding HGMMA must be found
    /// (the attention's key loop), and is reported; it must close no empty group (an HGMMA
    /// into RZ: [`Mix::hgmma_empty`]) and must hold a wait that leaves one group in flight
    /// ([`Mix::hgmma_wait_one`]: the softmax under the P V).
    Wgmma {
        /// HGMMA in the function, at least.
        hgmma: u32,
        /// Whether the HGMMA must sit in a loop.
        in_loop: bool,
    },
}

/// A malformed disassembly, or one without what the gate needs.
#[derive(Debug, thiserror::Error)]
pub enum SassError {
    /// The text could not be read.
    #[error("SASS: {0}")]
    Parse(String),
    /// nvdisasm could not be run, or failed.
    #[error("nvdisasm: {0}")]
    Tool(String),
}

/// One instruction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instr {
    /// Byte address in the function.
    pub addr: u32,
    /// The opcode with its modifiers (`HMMA.16816.F32.BF16`), without the predicate.
    pub opcode: String,
    /// The branch target label, for branches.
    pub target: Option<String>,
    /// The operands as written (`R24, gdesc[UR20], R24, gsb0`).
    pub operands: String,
}

impl Instr {
    /// The opcode without modifiers (`HMMA`).
    pub fn base(&self) -> &str {
        self.opcode.split('.').next().unwrap_or("")
    }
}

/// One function's instructions and where its labels point.
#[derive(Clone, Debug, Default)]
pub struct Function {
    /// The symbol.
    pub name: String,
    /// Instructions in address order.
    pub instrs: Vec<Instr>,
    /// Label -> index of the instruction that follows it.
    pub labels: HashMap<String, usize>,
}

/// Reads `nvdisasm -c` output: functions start at a `.text.<name>:` line, labels are `<name>:`
/// lines, instructions `/*addr*/ [@P] OPCODE operands ;`.
pub fn parse(text: &str) -> Result<Vec<Function>, SassError> {
    let mut out: Vec<Function> = Vec::new();
    for (no, line) in text.lines().enumerate() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix(".text.").and_then(|r| r.strip_suffix(':')) {
            out.push(Function { name: name.to_string(), ..Default::default() });
            continue;
        }
        let Some(f) = out.last_mut() else { continue };
        if let Some(rest) = t.strip_prefix("/*") {
            let (addr, body) =
                rest.split_once("*/").ok_or_else(|| SassError::Parse(format!("line {}: `{t}`: no address", no + 1)))?;
            let addr = u32::from_str_radix(addr.trim(), 16)
                .map_err(|_| SassError::Parse(format!("line {}: `{t}`: the address is not hex", no + 1)))?;
            let body = body.trim().trim_end_matches(';').trim();
            let mut words = body.split_whitespace();
            let mut op = words.next().unwrap_or("");
            if op.starts_with('@') {
                op = words.next().unwrap_or("");
            }
            if op.is_empty() || !op.starts_with(|c: char| c.is_ascii_uppercase()) {
                return Err(SassError::Parse(format!("line {}: `{t}`: no opcode", no + 1)));
            }
            let target = body.split_once("`(").and_then(|(_, r)| r.split_once(')')).map(|(l, _)| l.to_string());
            let operands = body.split_once(op).map_or("", |(_, r)| r.trim()).to_string();
            f.instrs.push(Instr { addr, opcode: op.to_string(), target, operands });
        } else if let Some(label) = t.strip_suffix(':') {
            if !label.is_empty() && !label.contains(char::is_whitespace) && label != f.name {
                f.labels.insert(label.to_string(), f.instrs.len());
            }
        }
    }
    if out.is_empty() {
        return Err(SassError::Parse("no function (`.text.<name>:`) in the disassembly".into()));
    }
    if let Some(f) = out.iter().find(|f| f.instrs.is_empty()) {
        return Err(SassError::Parse(format!("function {} has no instructions", f.name)));
    }
    Ok(out)
}

/// Instruction mix of a stretch of code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mix {
    /// Instructions (trailing NOP padding excluded).
    pub instrs: u32,
    /// Tensor-core matrix products (`mma.sync`).
    pub hmma: u32,
    /// Warpgroup matrix products (`wgmma.mma_async`, sm_90a).
    pub hgmma: u32,
    /// Shared-memory matrix loads (`ldmatrix`).
    pub ldsm: u32,
    /// Global-to-shared asynchronous copies (`cp.async`).
    pub ldgsts: u32,
    /// Barriers.
    pub bar: u32,
    /// Branches.
    pub branches: u32,
    /// Local-memory loads and stores (LDL, STL): a stack frame or spills.
    pub local: u32,
    /// Special-function unit instructions (MUFU: the softmax's exp2, reciprocals), 16 results
    /// a clock and SM on sm_80 and sm_90 against the FMA pipe's 128.
    pub mufu: u32,
    /// Warpgroup products into RZ (`HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0`): what
    /// ptxas issues for a `wgmma.commit_group` that closes no product, an empty group, which a
    /// `wgmma.wait_group` then counts like any other.
    pub hgmma_empty: u32,
    /// Waits for warpgroup products that leave one group in flight (`WARPGROUP.DEPBAR.LE gsb0,
    /// 0x1`: `wgmma.wait_group 1`), what lets a warpgroup's softmax run under its own P V.
    pub hgmma_wait_one: u32,
}

impl Mix {
    fn of(instrs: &[Instr]) -> Self {
        let mut m = Mix::default();
        for i in instrs {
            m.instrs += 1;
            match i.base() {
                "HMMA" => m.hmma += 1,
                "HGMMA" => {
                    m.hgmma += 1;
                    if i.operands.starts_with("RZ,") {
                        m.hgmma_empty += 1;
                    }
                }
                "LDSM" => m.ldsm += 1,
                "LDGSTS" => m.ldgsts += 1,
                "BAR" => m.bar += 1,
                b if is_branch(b) => m.branches += 1,
                "LDL" | "STL" => m.local += 1,
                "MUFU" => m.mufu += 1,
                "WARPGROUP"
                    if i.opcode.starts_with("WARPGROUP.DEPBAR") && i.operands.replace(' ', "") == "gsb0,0x1" =>
                {
                    m.hgmma_wait_one += 1
                }
                _ => {}
            }
        }
        m
    }

    /// Instructions per HGMMA (infinite without HGMMA).
    pub fn per_hgmma(&self) -> f64 {
        self.instrs as f64 / self.hgmma as f64
    }

    /// Instructions per HMMA (infinite without HMMA).
    pub fn per_hmma(&self) -> f64 {
        self.instrs as f64 / self.hmma as f64
    }

    /// HMMA per LDSM (infinite without LDSM).
    pub fn hmma_per_ldsm(&self) -> f64 {
        self.hmma as f64 / self.ldsm as f64
    }
}

/// A loop: the instructions from a label to the last branch back to it, inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loop {
    /// Index of its first instruction.
    pub start: usize,
    /// Index of its last instruction (the branch back).
    pub end: usize,
    /// What it holds.
    pub mix: Mix,
}

impl Loop {
    fn contains(&self, other: &Loop) -> bool {
        self.start <= other.start && other.end <= self.end && self != other
    }
}

/// The function's loops, one per loop head (the last branch back to it ends the loop), in
/// address order. A branch to itself (the `EXIT; BRA .` trap) is not a loop.
pub fn loops(f: &Function) -> Result<Vec<Loop>, SassError> {
    let mut ends: HashMap<usize, usize> = HashMap::new();
    for (i, ins) in f.instrs.iter().enumerate() {
        // Branches only: a call's return (`RET ... `(kernel)`) or a convergence barrier's
        // `BSSY` names a target too, and neither closes a loop.
        let Some(label) = ins.target.as_ref().filter(|_| is_branch(ins.base())) else { continue };
        let &at = f.labels.get(label).ok_or_else(|| {
            SassError::Parse(format!("{}: branch at {:#x} to unknown label {label}", f.name, ins.addr))
        })?;
        if at < i {
            let e = ends.entry(at).or_insert(i);
            *e = (*e).max(i);
        }
    }
    let mut out: Vec<Loop> =
        ends.into_iter().map(|(start, end)| Loop { start, end, mix: Mix::of(&f.instrs[start..=end]) }).collect();
    out.sort_by_key(|l| (l.start, l.end));
    Ok(out)
}

/// The steady-state tensor-core loop: among the innermost loops that hold HMMA (no loop with
/// HMMA inside them), the one with the fewest instructions per HMMA. `None` without HMMA loops.
pub fn steady_state(loops: &[Loop]) -> Option<(Loop, usize)> {
    innermost_with(loops, |m| m.hmma)
}

/// The innermost loop holding HGMMA with the fewest instructions per HGMMA, and how many
/// innermost HGMMA loops there are. `None` without one.
pub fn wgmma_state(loops: &[Loop]) -> Option<(Loop, usize)> {
    innermost_with(loops, |m| m.hgmma)
}

/// Among the innermost loops holding some of what `count` counts, the one with the fewest
/// instructions per counted instruction, and how many such innermost loops there are.
fn innermost_with(loops: &[Loop], count: fn(&Mix) -> u32) -> Option<(Loop, usize)> {
    let with: Vec<&Loop> = loops.iter().filter(|l| count(&l.mix) > 0).collect();
    let innermost: Vec<&Loop> = with.iter().copied().filter(|l| !with.iter().any(|o| l.contains(o))).collect();
    let per = |l: &Loop| l.mix.instrs as f64 / count(&l.mix) as f64;
    let best = innermost.iter().min_by(|a, b| per(a).total_cmp(&per(b)))?;
    Some((**best, innermost.len()))
}

/// The gate's row of one kernel on one architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The kernel.
    pub kernel: String,
    /// The whole function.
    pub total: Mix,
    /// Its steady-state tensor-core loop, and how many innermost tensor-core loops it has.
    pub steady: Option<(Loop, usize)>,
    /// Its innermost loop with warpgroup products (HGMMA) and the fewest instructions per
    /// HGMMA, and how many innermost HGMMA loops it has.
    pub wgmma_loop: Option<(Loop, usize)>,
}

impl Row {
    /// The row of `kernel` in `functions`; an error when it is not there, or when `budget`
    /// expects a tensor-core loop and none is found.
    pub fn of(functions: &[Function], kernel: &str, budget: SassBudget) -> Result<Self, SassError> {
        let f = functions.iter().find(|f| f.name == kernel).ok_or_else(|| {
            SassError::Parse(format!(
                "no function {kernel} in the disassembly (found: {})",
                functions.iter().map(|f| f.name.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        // Trailing padding is not code.
        let n = f.instrs.iter().rposition(|i| i.base() != "NOP").map_or(0, |p| p + 1);
        let total = Mix::of(&f.instrs[..n]);
        let all = loops(f)?;
        let steady = steady_state(&all);
        let wgmma_loop = wgmma_state(&all);
        if wgmma_loop.is_none() && matches!(budget, SassBudget::Wgmma { in_loop: true, .. }) {
            return Err(SassError::Parse(format!(
                "{kernel}: no loop with warpgroup products (HGMMA) found ({} instructions, {} HGMMA in the function)",
                total.instrs, total.hgmma
            )));
        }
        if steady.is_none() && matches!(budget, SassBudget::Reported | SassBudget::Loop { .. }) {
            return Err(SassError::Parse(format!(
                "{kernel}: no loop with tensor-core instructions (HMMA) found: the gate cannot read its \
                 steady state ({} instructions, {} HMMA in the function)",
                total.instrs, total.hmma
            )));
        }
        Ok(Self { kernel: kernel.to_string(), total, steady, wgmma_loop })
    }

    /// What breaks `budget` (empty: within it).
    pub fn check(&self, budget: SassBudget) -> Vec<String> {
        let mut out = Vec::new();
        if self.total.local > 0 {
            out.push(format!("{}: {} local-memory instructions (LDL/STL)", self.kernel, self.total.local));
        }
        if let SassBudget::Wgmma { hgmma, in_loop } = budget {
            if self.total.hgmma < hgmma {
                out.push(format!("{}: {} HGMMA, at least {hgmma} expected", self.kernel, self.total.hgmma));
            }
            if self.total.hmma > 0 {
                out.push(format!("{}: {} HMMA (a product fell back to mma.sync)", self.kernel, self.total.hmma));
            }
            if let Some((l, _)) = &self.wgmma_loop {
                if in_loop && l.mix.hgmma_wait_one == 0 {
                    out.push(format!(
                        "{}: no wait in the key loop that leaves a product group in flight (WARPGROUP.DEPBAR.LE \
                         gsb0, 0x1, wgmma.wait_group 1): the softmax cannot run under the P V",
                        self.kernel
                    ));
                }
                if l.mix.hgmma_empty > 0 {
                    out.push(format!(
                        "{}: {} empty warpgroup product group(s) in the key loop (HGMMA into RZ: a commit_group \
                         with no product since the last one, typically a product issued under a run-time test); \
                         a wait_group then also waits for the group before it",
                        self.kernel, l.mix.hgmma_empty
                    ));
                }
            }
        }
        if let (SassBudget::Loop { max_per_hmma, min_hmma_per_ldsm }, Some((l, _))) = (budget, &self.steady) {
            if l.mix.per_hmma() > max_per_hmma {
                out.push(format!(
                    "{}: {:.2} instructions per HMMA in the steady-state loop > budget {max_per_hmma}",
                    self.kernel,
                    l.mix.per_hmma()
                ));
            }
            if l.mix.hmma_per_ldsm() < min_hmma_per_ldsm {
                out.push(format!(
                    "{}: {:.2} HMMA per LDSM in the steady-state loop < budget {min_hmma_per_ldsm}",
                    self.kernel,
                    l.mix.hmma_per_ldsm()
                ));
            }
        }
        out
    }
}

/// Where nvdisasm is: `$FLOWPREFILL_NVDISASM` when set (it must then exist), else the copy
/// `scripts/cuda-wheels.sh nvdisasm` installs under `$FLOWPREFILL_HOME` (default
/// `~/.cache/flowprefill`), else `nvdisasm` on the PATH; `None` when none is there.
pub fn nvdisasm() -> Result<Option<PathBuf>, SassError> {
    if let Some(p) = std::env::var_os("FLOWPREFILL_NVDISASM") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(Some(p))
        } else {
            Err(SassError::Tool(format!(
                "FLOWPREFILL_NVDISASM={} is not a file (bash scripts/cuda-wheels.sh nvdisasm installs it and \
                 prints its path)",
                p.display()
            )))
        };
    }
    let wheel = crate::flowprefill_home().join("cuda-wheels/nvdisasm/nvidia/cu13/bin/nvdisasm");
    if wheel.is_file() {
        return Ok(Some(wheel));
    }
    let on_path = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|d| d.join("nvdisasm")).find(|p| p.is_file()));
    Ok(on_path)
}

/// Disassembles `cubin` with the nvdisasm at `tool` (`nvdisasm -c`: code only).
pub fn disassemble(tool: &Path, cubin: &[u8]) -> Result<String, SassError> {
    let dir = std::env::temp_dir();
    let file = dir.join(format!("flowprefill-sass-{}-{:x}.cubin", std::process::id(), fnv(cubin)));
    std::fs::write(&file, cubin).map_err(|e| SassError::Tool(format!("writing {}: {e}", file.display())))?;
    let out = std::process::Command::new(tool).arg("-c").arg(&file).output();
    let _ = std::fs::remove_file(&file);
    let out = out.map_err(|e| SassError::Tool(format!("running {}: {e}", tool.display())))?;
    if !out.status.success() {
        return Err(SassError::Tool(format!(
            "{} -c failed ({}): {}",
            tool.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    String::from_utf8(out.stdout).map_err(|_| SassError::Tool("the disassembly is not UTF-8".into()))
}

fn is_branch(base: &str) -> bool {
    matches!(base, "BRA" | "BRX" | "JMP" | "JMX")
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel with a two-level loop nest: an outer loop holding a tensor-core inner loop, and
    /// a stack store.
    const TEXT: &str = "
//--------------------- .text.k --------------------------
k:
.text.k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2 ;
.L_x_0:
        /*0020*/                   IADD3 R3, R3, 0x1, RZ ;
.L_x_1:
        /*0030*/                   LDSM.16.M88.4 R4, [R5+0x100] ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0050*/                   HMMA.16816.F32.BF16 R12, R4, R7, R12 ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
        /*00a0*/                   NOP;
";

    #[test]
    fn the_inner_tensor_core_loop_is_the_steady_state() {
        let f = parse(TEXT).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].instrs.len(), 11);
        let l = loops(&f[0]).unwrap();
        assert_eq!(l.len(), 2, "{l:?}");
        let (s, n) = steady_state(&l).unwrap();
        assert_eq!((s.start, s.end, n), (3, 6, 1));
        assert_eq!((s.mix.instrs, s.mix.hmma, s.mix.ldsm, s.mix.branches), (4, 2, 1, 1));
        let row = Row::of(&f, "k", SassBudget::Loop { max_per_hmma: 2.0, min_hmma_per_ldsm: 2.0 }).unwrap();
        assert_eq!(row.total.instrs, 10, "the trailing NOP is padding");
        // The stack store breaks the no-local-memory rule; the loop is within its budget.
        assert_eq!(row.check(SassBudget::Loop { max_per_hmma: 2.0, min_hmma_per_ldsm: 2.0 }).len(), 1);
        // Tighter budgets break on both counts.
        let broken = row.check(SassBudget::Loop { max_per_hmma: 1.5, min_hmma_per_ldsm: 3.0 });
        assert_eq!(broken.len(), 3, "{broken:?}");
        assert!(broken[1].contains("2.00 instructions per HMMA") && broken[2].contains("HMMA per LDSM"), "{broken:?}");
    }

    #[test]
    fn special_function_instructions_are_counted() {
        let f = parse(
            ".text.k:\n /*0000*/ MUFU.EX2 R1, R2 ;\n /*0010*/ FFMA R3, R1, R4, R5 ;\n /*0020*/ MUFU.RCP R6, R7 ;\n",
        )
        .unwrap();
        let m = Mix::of(&f[0].instrs);
        assert_eq!((m.instrs, m.mufu), (3, 2));
    }

    /// A key loop whose second group may be empty (its products under a run-time test) holds the
    /// placeholder product ptxas closes it with, and one that waits for every group lets no
    /// softmax run under a P V; the gate names each.
    #[test]
    fn a_key_loop_must_keep_its_p_v_in_flight_and_close_no_empty_group() {
        let text = |placeholder: &str| {
            format!(
                ".text.k:\n.L_x_0:\n /*0000*/ WARPGROUP.ARRIVE ;\n\
                 /*0010*/ HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT, gsb0 ;\n\
                 /*0020*/ @!P1 BRA `(.L_x_1) ;\n\
                 /*0030*/ HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8].tnspB, R88, gsb0 ;\n\
                 .L_x_1:\n{placeholder}\
                 /*0050*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n\
                 /*0060*/ @P0 BRA `(.L_x_0) ;\n /*0070*/ EXIT ;\n"
            )
        };
        let budget = SassBudget::Wgmma { hgmma: 2, in_loop: true };
        let bad = parse(&text(" /*0040*/ HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0 ;\n")).unwrap();
        let row = Row::of(&bad, "k", budget).unwrap();
        let (l, _) = row.wgmma_loop.unwrap();
        assert_eq!((l.mix.hgmma, l.mix.hgmma_empty), (3, 1));
        let broken = row.check(budget);
        assert!(broken.len() == 1 && broken[0].contains("1 empty warpgroup product group"), "{broken:?}");
        let good = parse(&text("")).unwrap();
        assert!(Row::of(&good, "k", budget).unwrap().check(budget).is_empty());
        // A loop that waits for every group: no overlap of the softmax with the P V.
        let serial = parse(&text("").replace("gsb0, 0x1", "gsb0, 0x0")).unwrap();
        let broken = Row::of(&serial, "k", budget).unwrap().check(budget);
        assert!(broken.len() == 1 && broken[0].contains("no wait in the key loop"), "{broken:?}");
    }

    #[test]
    fn what_the_gate_cannot_read_is_an_error() {
        assert!(parse("nothing here").is_err(), "no function");
        assert!(parse(".text.k:\n").is_err(), "no instructions");
        assert!(parse(".text.k:\n /*00zz*/ MOV R1, R2 ;\n").is_err(), "a bad address");
        let no_label = ".text.k:\n /*0000*/ BRA `(.L_x_9) ;\n";
        assert!(loops(&parse(no_label).unwrap()[0]).is_err(), "a branch to a label that is not there");
        let plain = parse(".text.k:\n /*0000*/ EXIT ;\n").unwrap();
        assert!(Row::of(&plain, "k", SassBudget::Reported).is_err(), "an attention kernel without its loop");
        assert!(Row::of(&plain, "k", SassBudget::Plain).is_ok());
        assert!(Row::of(&plain, "other", SassBudget::Plain).is_err(), "a kernel that is not there");
    }
}
