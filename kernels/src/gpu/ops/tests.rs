//! The launch builders' plans, metadata, type checks and launch shapes.

use super::*;
use crate::gpu::shapes;

fn dims(m: u32, n: u32, h: u32, kv: u32, d: u32) -> AttnDims {
    AttnDims { m, n, n_heads: h, n_kv_heads: kv, head_dim: d }
}

#[test]
fn plans_split_keys_only_when_blocks_are_few() {
    // Prefill of an 8B shape at 8K: 512 q tiles x 8 heads, no split.
    let p = flash_plan(dims(8192, 8192, 32, 8, 128), FlashKernel::Reference, 132, None);
    assert_eq!((p.q_tiles, p.key_tiles, p.splits, p.tiles_per_split), (512, 128, 1, 128));
    // FlashAttention-2's 128-row blocks: half the query tiles, the same key tiles.
    let p = flash_plan(dims(8192, 8192, 32, 8, 128), FlashKernel::Fa2(0), 132, None);
    assert_eq!((p.q_tiles, p.key_tiles, p.splits, p.tiles_per_split), (256, 128, 1, 128));
    // Decode of SmolLM2 at 8K: 1 q tile x 3 heads: 64 splits of 2 tiles.
    let p = flash_plan(dims(1, 8192, 9, 3, 64), FlashKernel::Reference, 132, None);
    assert_eq!((p.q_tiles, p.splits, p.tiles_per_split), (1, 64, 2));
    assert!(p.splits * p.tiles_per_split >= p.key_tiles);
    // Few keys: never more splits than key tiles; no keys: one split of nothing.
    assert_eq!(flash_plan(dims(1, 100, 9, 3, 64), FlashKernel::Fa2(0), 132, None).splits, 2);
    let p = flash_plan(dims(3, 0, 9, 3, 64), FlashKernel::Fa2(0), 132, None);
    assert_eq!((p.key_tiles, p.splits), (0, 1));
    // Forced splits cover every tile exactly once.
    for (force, kernel) in (1..9).flat_map(|f| FlashKernel::every().into_iter().map(move |k| (f, k))) {
        let p = flash_plan(dims(17, 1000, 7, 1, 64), kernel, 132, Some(force));
        assert!(p.splits <= force && (p.splits - 1) * p.tiles_per_split < p.key_tiles);
        assert!(p.splits * p.tiles_per_split >= p.key_tiles);
        // The Hopper kernel's splits are cut on its 128-key tiles.
        assert!(!kernel.is_hopper() || p.tiles_per_split.is_multiple_of(2), "{p:?}");
    }
}

#[test]
fn key_meta_has_positions_then_tile_ranges() {
    let kpos: Vec<u32> = (0..130).rev().collect();
    let meta = key_meta(&kpos);
    assert_eq!(meta.len(), 130 + 2 * 3);
    assert_eq!(&meta[..130], &kpos[..]);
    assert_eq!(&meta[130..133], &[66, 2, 0]);
    assert_eq!(&meta[133..136], &[129, 65, 1]);
    let (lo, hi) = tile_ranges(Ptr::new(1000, Elem::U32), 130);
    assert_eq!((lo.addr, hi.addr), (1000 + 4 * 130, 1000 + 4 * 133));
}

#[test]
fn builders_refuse_the_wrong_element_types() {
    let f = Ptr::new(0, Elem::F32);
    let b = Ptr::new(0, Elem::Bf16);
    let u = Ptr::new(0, Elem::U32);
    assert!(copy_columns(u, 4, 0, 4, f, 1).is_err());
    assert_eq!(copy_columns(b, 4, 0, 4, f, 1).unwrap().kernel, "fp_copy_columns_from_bf16");
    assert_eq!(copy_columns(f, 4, 0, 4, b, 1).unwrap().kernel, "fp_copy_columns_to_bf16");
    assert!(silu_mul(b, f, 1, 1).is_err(), "gate-up and output of one type");
    assert!(rms_norm(b, f, 1e-5, f, 1, 1).is_err(), "x and out of one type");
    assert!(rms_norm(b, b, 1e-5, b, 1, 1).is_err(), "an f32 weight");
    assert_eq!(rms_norm(b, f, 1e-5, b, 1, 8).unwrap().kernel, "fp_rms_norm_bf16");
    assert!(add_bias(u, f, 1, 1).is_err());
    assert!(copy_rows(f, u, b, u, 1, 1).is_err());
    assert!(add_assign(b, f, 1).is_err());
    let d = dims(1, 1, 1, 1, 64);
    let plan = flash_plan(d, FlashKernel::Reference, 1, None);
    assert!(flash_attention(d, &plan, f, u, b, b, u, f, f, None, 1.0).is_err());
    assert!(flash_attention(dims(1, 1, 1, 1, 80), &plan, b, u, b, b, u, f, f, None, 1.0).is_err());
    let calls = flash_attention(d, &plan, b, u, b, b, u, f, f, None, 1.0).unwrap();
    assert_eq!(calls.len(), 1);
    calls[0].check().unwrap();
    assert_eq!(calls[0].launch.shared_bytes, flash_shared_bytes(64));
    // Splits need the partial buffers, and add the combine.
    let fa2 = flash_attention(d, &flash_plan(d, FlashKernel::Fa2(0), 1, None), b, u, b, b, u, f, f, None, 1.0).unwrap();
    assert_eq!(fa2[0].kernel, "fp_flash2_attn_d64");
    assert_eq!(fa2[0].launch.shared_bytes, FlashKernel::Fa2(0).shared_bytes(64));
    fa2[0].check().unwrap();
    let split = flash_plan(dims(1, 640, 1, 1, 64), FlashKernel::Reference, 132, None);
    assert!(split.splits > 1);
    assert!(flash_attention(dims(1, 640, 1, 1, 64), &split, b, u, b, b, u, f, f, None, 1.0).is_err());
    let calls = flash_attention(dims(1, 640, 1, 1, 64), &split, b, u, b, b, u, f, f, Some((f, f)), 1.0).unwrap();
    assert_eq!(calls.iter().map(|c| c.kernel).collect::<Vec<_>>(), ["fp_flash_attn_d64", "fp_attn_combine"]);
    calls.iter().for_each(|c| c.check().unwrap());
    assert!(attention(d, f, u, b, f, u, f, f, 1.0).is_err(), "k and v of different types");
}

/// An attention output is f32 or bf16: the kernels take it as a pair of pointers, the other one
/// null; with key splits the kernel writes the f32 partials and the combine the output.
#[test]
fn attention_outputs_are_f32_or_bf16() {
    let (b, u) = (Ptr::new(0x100, Elem::Bf16), Ptr::new(0x200, Elem::U32));
    let (f, out_b) = (Ptr::new(0x300, Elem::F32), Ptr::new(0x400, Elem::Bf16));
    let part = (Ptr::new(0x500, Elem::F32), Ptr::new(0x600, Elem::F32));
    let pair = |c: &Call, at: usize| match (&c.args[at], &c.args[at + 1]) {
        (Arg::Ptr(o), Arg::Ptr(ob)) => (o.addr, ob.addr),
        other => panic!("{}: {other:?}", c.kernel),
    };
    let d = dims(1, 1, 1, 1, 64);
    for kernel in [FlashKernel::Reference, FlashKernel::Fa2(0)] {
        let plan = flash_plan(d, kernel, 1, None);
        let whole = flash_attention(d, &plan, b, u, b, b, u, out_b, f, None, 1.0).unwrap();
        whole[0].check().unwrap();
        assert_eq!(pair(&whole[0], 7), (0, 0x400), "{kernel:?}: bf16 out from the kernel");
        assert_eq!(pair(&flash_attention(d, &plan, b, u, b, b, u, f, f, None, 1.0).unwrap()[0], 7), (0x300, 0));
        assert!(flash_attention(d, &plan, b, u, b, b, u, u, f, None, 1.0).is_err(), "u32 out");
        let dn = dims(1, 640, 1, 1, 64);
        let split = flash_plan(dn, kernel, 132, None);
        assert!(split.splits > 1);
        let calls = flash_attention(dn, &split, b, u, b, b, u, out_b, f, Some(part), 1.0).unwrap();
        calls.iter().for_each(|c| c.check().unwrap());
        assert_eq!(pair(&calls[0], 7), (0x500, 0), "{kernel:?}: f32 partials");
        assert_eq!(pair(&calls[1], 2), (0, 0x400), "{kernel:?}: bf16 out from the combine");
        let bad = (Ptr::new(0x500, Elem::Bf16), part.1);
        assert!(flash_attention(dn, &split, b, u, b, b, u, out_b, f, Some(bad), 1.0).is_err(), "bf16 partials");
    }
    let simple = attention(d, f, u, b, b, u, out_b, f, 1.0).unwrap();
    simple.check().unwrap();
    assert_eq!(pair(&simple, 5), (0, 0x400));
    assert!(attention(d, f, u, b, b, u, u, f, 1.0).is_err(), "u32 out");
}

/// The launch shapes are written once, in `shapes.rs`: no `.cu` file defines one, the header
/// defines every one the sources use, and every configuration's tile divides the metadata's.
#[test]
fn launch_shapes_come_from_the_header_only() {
    for f in super::super::FILES {
        for line in f.source.lines() {
            let l = line.trim_start();
            assert!(
                !(l.starts_with("#define FP_FA") || l.starts_with("#define fp_flash")),
                "{}: `{l}`: launch shapes belong to gpu/shapes.rs",
                f.name
            );
        }
    }
    let used = ["FP_FA_ROWS", "FP_FA_KEYS", "FP_FA_THREADS", "FP_FA2_META_KEYS", "FP_FA2_RESCALE"];
    for c in 0..shapes::FA2_CONFIGS.len() {
        let h = shapes::header(c);
        for d in [64u32, 128] {
            let s = shapes::FA2_CONFIGS[c].at(d);
            for (m, v) in [("WARPS", s.warps), ("WM", s.wm), ("KEYS", s.keys), ("MINB", s.min_blocks)] {
                assert!(h.contains(&format!("#define FP_FA2_D{d}_{m} {v}\n")), "config {c}: {m}\n{h}");
            }
            assert!(
                FLASH_KEYS.is_multiple_of(s.keys),
                "config {c} d{d}: a kernel tile must divide the metadata's tile"
            );
            let k = FlashKernel::Fa2(c as u8);
            assert_eq!(k.kernel(d), shapes::fa2_kernel(c, d));
            assert_eq!(shapes::base_kernel(k.kernel(d).unwrap()), format!("fp_flash2_attn_d{d}"));
            assert_eq!(k.name().parse::<FlashKernel>(), Ok(k));
        }
        for m in used {
            assert!(h.contains(&format!("#define {m} ")), "config {c}: {m}");
        }
        assert_eq!(c != 0, h.contains("#define fp_flash2_attn_d128 fp_flash2_attn_d128_c"), "config {c}");
    }
    assert_eq!("reference".parse::<FlashKernel>(), Ok(FlashKernel::Reference));
    assert!("fast".parse::<FlashKernel>().unwrap_err().contains("fa2:c1"));
}

#[test]
fn the_hopper_kernel_is_planned_on_its_tiles_and_takes_tensor_maps() {
    let d = dims(300, 1000, 8, 2, 128);
    let plan = flash_plan(d, FlashKernel::Hopper(0), 132, Some(3));
    assert_eq!(plan.q_tiles, (300u32 * 4).div_ceil(128));
    assert_eq!(plan.tiles_per_split % (HOPPER_KEYS / FLASH_KEYS), 0, "{plan:?}");
    let (q, u, f) = (Ptr::new(0, Elem::Bf16), Ptr::new(0, Elem::U32), Ptr::new(0, Elem::F32));
    let maps = Ptr::new(0, Elem::U64);
    let e = flash_attention(d, &plan, q, u, q, q, u, f, f, Some((f, f)), 1.0).expect_err("no maps");
    assert!(e.to_string().contains("hopper_attention"), "{e}");
    let calls = hopper_attention(d, &plan, maps, q, u, u, f, f, Some((f, f)), 1.0).unwrap();
    assert_eq!(calls[0].kernel, "fp_flash_hopper_d128");
    assert_eq!(calls[0].launch.block, [384, 1, 1]);
    // Q, 3 stages of K and V, the alignment, per stage two barriers and the producer's word.
    assert_eq!(calls[0].launch.shared_bytes, 128 * 128 * 2 + 2 * 3 * 128 * 128 * 2 + 1024 + 3 * 20);
    assert_eq!(calls[0].launch.grid, [plan.q_tiles, 2, plan.splits]);
    assert_eq!(plan.blocks, plan.q_tiles * 2 * plan.splits);
    calls.iter().for_each(|c| c.check().unwrap_or_else(|e| panic!("{e}")));
    // The persistent configuration: as many items, at most a block per SM, a one-dimensional grid.
    for (sms, blocks) in [(132, 60), (7, 7)] {
        let p7 = flash_plan(d, FlashKernel::Hopper(7), sms, Some(3));
        assert_eq!((p7.q_tiles, p7.splits, p7.blocks), (plan.q_tiles, plan.splits, blocks), "{sms} SMs");
        let calls = hopper_attention(d, &p7, maps, q, u, u, f, f, Some((f, f)), 1.0).unwrap();
        assert_eq!((calls[0].kernel, calls[0].launch.grid), ("fp_flash_hopper_d128_c7", [blocks, 1, 1]));
        calls.iter().for_each(|c| c.check().unwrap_or_else(|e| panic!("{e}")));
    }
    let fa2 = flash_plan(d, FlashKernel::Fa2(0), 132, None);
    assert!(hopper_attention(d, &fa2, maps, q, u, u, f, f, None, 1.0).is_err(), "a flash2 plan");
    assert!(hopper_attention(d, &plan, u, q, u, u, f, f, Some((f, f)), 1.0).is_err(), "maps as u32");
    // Maps over [n, n_kv_heads, d]: rows of one key's heads, boxes of one head's 64 dims.
    let k = Ptr::new(0x10000, Elem::Bf16);
    let [km, vm] = hopper_attention_maps(d, k, k.at(1000 * 256)).unwrap().expect("maps");
    assert_eq!((km.dims, km.row_bytes, km.boxed), ([256, 1000], 512, [64, HOPPER_KEYS]));
    assert_eq!(vm.base, 0x10000 + 1000 * 256 * 2);
    assert!(hopper_attention_maps(dims(4, 0, 8, 2, 128), k, k).unwrap().is_none(), "no keys, no maps");
    assert_eq!("hopper".parse::<FlashKernel>(), Ok(FlashKernel::Hopper(0)));
    // The one-consumer configuration: 64-row blocks of 256 threads, its own kernel name.
    let one = FlashKernel::Hopper(3);
    assert_eq!("hopper:c3".parse::<FlashKernel>(), Ok(one));
    let plan = flash_plan(d, one, 132, Some(3));
    assert_eq!(plan.q_tiles, (300u32 * 4).div_ceil(64));
    let calls = hopper_attention(d, &plan, maps, q, u, u, f, f, Some((f, f)), 1.0).unwrap();
    assert_eq!((calls[0].kernel, calls[0].launch.block), ("fp_flash_hopper_d128_c3", [256, 1, 1]));
    assert_eq!(calls[0].launch.shared_bytes, 64 * 128 * 2 + 2 * 3 * 128 * 128 * 2 + 1024 + 3 * 20);
    calls.iter().for_each(|c| c.check().unwrap_or_else(|e| panic!("{e}")));
    // Three consumers at d64 (192-row blocks of 512 threads), two at d128.
    let three = FlashKernel::Hopper(6);
    let d64 = dims(300, 1000, 8, 2, 64);
    let plan = flash_plan(d64, three, 132, Some(3));
    assert_eq!(plan.q_tiles, (300u32 * 4).div_ceil(192));
    let calls = hopper_attention(d64, &plan, maps, q, u, u, f, f, Some((f, f)), 1.0).unwrap();
    assert_eq!((calls[0].kernel, calls[0].launch.block), ("fp_flash_hopper_d64_c6", [512, 1, 1]));
    assert_eq!(calls[0].launch.shared_bytes, 192 * 64 * 2 + 2 * 3 * 128 * 64 * 2 + 1024 + 3 * 20);
    assert_eq!((three.rows(128), three.threads(128)), (128, 384));
    // Every configuration fits a Hopper SM's 227 KB of shared memory at d128.
    for k in FlashKernel::every().into_iter().filter(|k| k.is_hopper()) {
        assert!(k.shared_bytes(128) <= 227 * 1024, "{k:?}: {}", k.shared_bytes(128));
    }
}
