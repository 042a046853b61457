//! Backends that pass ops on to others, written once: the list of [`Backend`]'s ops
//! ([`for_each_backend_op!`](crate::for_each_backend_op)) and the macros that turn it into an
//! `impl Backend` whose every op not written by hand calls another backend's. A wrapper (a
//! test backend that counts or limits what runs on the CPU) implements [`Wrapper`] and
//! [`forward_backend!`](crate::forward_backend) writes the rest; [`crate::device::Device`]
//! dispatches each op to its CPU or GPU the same way. A new op is added to the trait, the
//! backends that compute it, and the list here, which checks itself against the trait
//! (a test), so no forwarding backend restates it.
//!
//! How: the list goes through a filter macro, defined by the `impl` being written, with one
//! arm per op that is written by hand or left to the trait's default (it drops them); each
//! op left is sorted by the kinds of its parameters and result (this backend's buffer, matrix
//! or mark, or anything else) and handed to a forwarder macro that writes the method.

use super::{Backend, Result};

/// A backend that runs its ops on another one, the inner backend:
/// [`forward_backend!`](crate::forward_backend) writes each op not written by hand as the
/// inner backend's, through these conversions. Matrices and marks are the inner backend's.
pub trait Wrapper: Backend {
    /// The backend that computes.
    type Inner: Backend;
    /// The inner backend.
    fn inner(&self) -> &Self::Inner;
    /// The inner backend's buffer in `buf`.
    fn buf(buf: &Self::Buf) -> &<Self::Inner as Backend>::Buf;
    /// The inner backend's buffer in `buf`, writable.
    fn buf_mut(buf: &mut Self::Buf) -> &mut <Self::Inner as Backend>::Buf;
    /// A buffer the inner backend made, as this backend's (the limiting test backend charges
    /// it to its ledger here).
    fn adopt(&self, buf: <Self::Inner as Backend>::Buf) -> Result<Self::Buf>;
}

/// Implements [`Backend`](crate::Backend) for a [`Wrapper`](crate::Wrapper): the `fn`s
/// written inside as they are, the ops named in `defaults(..)` by the trait's default bodies
/// (which then call this backend's ops, not the inner one's), and every other op as a call
/// to the inner backend (buffer arguments through [`Wrapper::buf`](crate::Wrapper::buf) and
/// [`Wrapper::buf_mut`](crate::Wrapper::buf_mut), buffers it returns through
/// [`Wrapper::adopt`](crate::Wrapper::adopt)). `type Buf` is given; `Mat` and `Mark` are the
/// inner backend's.
///
/// ```
/// use flowprefill_kernels::{Backend, Cpu, HostBuf, Result, Wrapper};
///
/// /// The CPU under another name.
/// struct Renamed(Cpu);
///
/// impl Wrapper for Renamed {
///     type Inner = Cpu;
///     fn inner(&self) -> &Cpu {
///         &self.0
///     }
///     fn buf(buf: &HostBuf) -> &HostBuf {
///         buf
///     }
///     fn buf_mut(buf: &mut HostBuf) -> &mut HostBuf {
///         buf
///     }
///     fn adopt(&self, buf: HostBuf) -> Result<HostBuf> {
///         Ok(buf)
///     }
/// }
///
/// flowprefill_kernels::forward_backend! {
///     impl Backend for Renamed {
///         type Buf = HostBuf;
///         // The trait's `memory` (unknown), not the CPU's.
///         defaults(memory);
///         fn name(&self) -> &'static str {
///             "renamed"
///         }
///     }
/// }
///
/// let be = Renamed(Cpu);
/// assert_eq!(be.name(), "renamed");
/// assert_eq!(be.download(&be.upload(&[1.0, 2.0])?)?, vec![1.0, 2.0]);
/// assert!(be.memory().is_none());
/// # Ok::<(), flowprefill_kernels::KernelError>(())
/// ```
#[macro_export]
macro_rules! forward_backend {
    (
        impl Backend for $w:ty {
            type Buf = $buf:ty;
            $(defaults($($default:ident),* $(,)?);)?
            $($(#[$meta:meta])* fn $f:ident $sig:tt $(-> $ret:ty)? $body:block)*
        }
    ) => {
        $crate::__impl_backend! {
            ($) [$crate::__forward_wrapped] [$w;] [$($($default)*)?]
            impl Backend for $w {
                type Buf = $buf;
                type Mat = <<$w as $crate::Wrapper>::Inner as $crate::Backend>::Mat;
                type Mark = <<$w as $crate::Wrapper>::Inner as $crate::Backend>::Mark;
                $($(#[$meta])* fn $f $sig $(-> $ret)? $body)*
            }
        }
    };
}

/// [`forward_backend!`] for a backend with a forwarder macro of its own (the dispatch of
/// [`crate::device::Device`]): `forward_with(m)` hands each op left to `m!` as `name (params)
/// [kind] [-> return] [(kind param)..]` (see [`for_each_backend_op!`] for the kinds; a
/// parameter's kind is `buf`, `buf_mut`, `mat`, `mark` or `value`); the associated types are
/// given.
macro_rules! forward_backend_with {
    (
        impl Backend for $w:ty {
            forward_with($fw:ident);
            $(defaults($($default:ident),* $(,)?);)?
            $(type $assoc:ident = $aty:ty;)*
            $($(#[$meta:meta])* fn $f:ident $sig:tt $(-> $ret:ty)? $body:block)*
        }
    ) => {
        crate::__impl_backend! {
            ($) [$fw] [] [$($($default)*)?]
            impl Backend for $w {
                $(type $assoc = $aty;)*
                $($(#[$meta])* fn $f $sig $(-> $ret)? $body)*
            }
        }
    };
}
pub(crate) use forward_backend_with;

/// The engine of [`forward_backend!`] and of [`crate::device::Device`]'s dispatch: `($)`, the
/// forwarder macro, its leading arguments, the ops left to the trait's defaults, then the
/// `impl` with its associated types and hand-written `fn`s. Defines the filter that drops
/// the written and defaulted ops from the list, inside an anonymous `const` so that two
/// impls in one module do not meet.
#[doc(hidden)]
#[macro_export]
macro_rules! __impl_backend {
    (
        ($d:tt) [$($forward:tt)+] [$($arg:tt)*] [$($default:ident)*]
        impl Backend for $w:ty {
            $(type $assoc:ident = $aty:ty;)*
            $($(#[$meta:meta])* fn $f:ident $sig:tt $(-> $ret:ty)? $body:block)*
        }
    ) => {
        const _: () = {
            macro_rules! __unless_written {
                $(($default $d($d t:tt)*) => {};)*
                $(($f $d($d t:tt)*) => {};)*
                ($d($d t:tt)*) => { $crate::__backend_op! { [$($forward)+] [$($arg)*] $d($d t)* } };
            }
            impl $crate::Backend for $w {
                $(type $assoc = $aty;)*
                $($(#[$meta])* fn $f $sig $(-> $ret)? $body)*
                $crate::for_each_backend_op!(__unless_written);
            }
            // A name in `defaults` that is no op of the trait is an error, not an op forwarded.
            $(let _ = <$w as $crate::Backend>::$default;)*
        };
    };
}

/// Calls the macro `$m` once per op of [`Backend`](crate::Backend) with
/// `name (params after &self) [kind] [-> return type]`, where kind is `buf`, `mat` or `mark`
/// for an op that returns `Result` of this backend's buffer, matrix or mark, `result` for
/// another `Result` and `value` for the rest. The one list of the trait's signatures that
/// forwarding backends are written from (a test holds it to the trait).
#[doc(hidden)]
#[macro_export]
macro_rules! for_each_backend_op {
    ($m:ident) => {
        $crate::__backend_ops! { $m
            fn name() -> &'static str;
            fn upload(host: &[f32]) -> Result<Self::Buf>;
            fn download(buf: &Self::Buf) -> Result<Vec<f32>>;
            fn download_range(buf: &Self::Buf, start: usize, len: usize) -> Result<Vec<f32>>;
            fn zeros(len: usize) -> Result<Self::Buf>;
            fn zeros_as(len: usize, dtype: $crate::DType) -> Result<Self::Buf>;
            fn dtype(buf: &Self::Buf) -> $crate::DType;
            fn kv_dtype() -> $crate::DType;
            fn act_dtype() -> $crate::DType;
            fn len(buf: &Self::Buf) -> usize;
            fn bytes(buf: &Self::Buf) -> usize;
            fn resize(buf: &mut Self::Buf, len: usize) -> Result<()>;
            fn reserve(buf: &mut Self::Buf, capacity: usize) -> Result<()>;
            fn matrix(m: $crate::matmul::Matrix) -> Result<Self::Mat>;
            fn weight_dtype() -> $crate::DType;
            fn matrix_typed(rows: usize, cols: usize, data: $crate::HostBuf) -> Result<Self::Mat>;
            fn mat_shape(m: &Self::Mat) -> (usize, usize);
            fn embedding(table: &Self::Mat, ids: &[u32], out: &mut Self::Buf) -> Result<()>;
            fn matmul_t(x: &Self::Buf, rows: usize, w: &Self::Mat, out: &mut Self::Buf) -> Result<()>;
            fn matmul_t_acc(x: &Self::Buf, rows: usize, w: &Self::Mat, out: &mut Self::Buf) -> Result<()>;
            fn add_bias(x: &mut Self::Buf, bias: &Self::Buf) -> Result<()>;
            fn rms_norm(x: &Self::Buf, w: &Self::Buf, eps: f32, out: &mut Self::Buf) -> Result<()>;
            fn rope(x: &mut Self::Buf, n_heads: usize, positions: &[u32], table: &$crate::rope::RopeTable)
                -> Result<()>;
            fn attention(
                shape: &$crate::attention::AttnShape, q: &Self::Buf, qpos: &[u32], k: &Self::Buf, v: &Self::Buf,
                kpos: &[u32], out: &mut Self::Buf, lse: &mut Self::Buf
            ) -> Result<()>;
            fn attention_rows(
                shape: &$crate::attention::AttnShape, q: &Self::Buf, q_first: usize, qpos: &[u32], k: &Self::Buf,
                v: &Self::Buf, k_first: usize, kpos: &[u32], out: &mut Self::Buf, lse: &mut Self::Buf
            ) -> Result<()>;
            fn attention_scores(
                shape: &$crate::attention::AttnShape, q: &Self::Buf, qpos: &[u32], k: &Self::Buf, kpos: &[u32],
                lse: &Self::Buf, scores: &mut Self::Buf
            ) -> Result<()>;
            fn merge_partial(
                out: &mut Self::Buf, lse: &mut Self::Buf, block_out: &Self::Buf, block_lse: &Self::Buf,
                head_dim: usize
            ) -> Result<()>;
            fn silu_mul(gate_up: &Self::Buf, ffn: usize, out: &mut Self::Buf) -> Result<()>;
            fn add_assign(x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;
            fn copy_columns(src: &Self::Buf, src_cols: usize, col: usize, width: usize, dst: &mut Self::Buf)
                -> Result<()>;
            fn copy_rows(
                src: &Self::Buf, src_rows: &[usize], dst: &mut Self::Buf, dst_rows: &[usize], row_len: usize
            ) -> Result<()>;
            fn append(dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;
            fn append_rows(dst: &mut Self::Buf, src: &Self::Buf, first: usize, rows: usize, width: usize)
                -> Result<()>;
            fn put_rows(dst: &mut Self::Buf, src: &Self::Buf, at: usize, width: usize) -> Result<()>;
            fn record(values: $crate::backend::StepValues, step: &mut dyn FnMut() -> $crate::Result<()>)
                -> Result<Option<$crate::backend::Recorded>>;
            fn download_typed(buf: &Self::Buf) -> Result<$crate::HostBuf>;
            fn upload_typed(host: &$crate::HostBuf) -> Result<Self::Buf>;
            fn download_many(bufs: &[&Self::Buf]) -> Result<Vec<$crate::HostBuf>>;
            fn upload_many(hosts: &[&$crate::HostBuf]) -> Result<Vec<Self::Buf>>;
            fn stage_out(buf: &Self::Buf) -> Result<$crate::HostBuf>;
            fn stage_in(host: &$crate::HostBuf) -> Result<Self::Buf>;
            fn rope_copy(src: &Self::Buf, n_heads: usize, positions: &[u32], table: &$crate::rope::RopeTable)
                -> Result<Self::Buf>;
            fn split_qkv_rope(
                qkv: &Self::Buf, heads: (usize, usize), positions: &[u32], table: &$crate::rope::RopeTable,
                q: &mut Self::Buf, k_pre: &mut Self::Buf, k: &mut Self::Buf, v: &mut Self::Buf
            ) -> Result<()>;
            fn duplicate(src: &Self::Buf) -> Result<Self::Buf>;
            fn mark() -> Result<Self::Mark>;
            fn seconds_between(start: &Self::Mark, end: &Self::Mark) -> Result<f64>;
            fn settle() -> Result<()>;
            fn memory() -> Option<$crate::Memory>;
            fn memory_use() -> Option<$crate::MemoryUse>;
            fn reset_memory_peak();
            fn release_unused();
            fn scratch_bytes(rows: usize, width: usize) -> usize;
            fn prefill_rows() -> usize;
            fn gathered_keys() -> usize;
        }
    };
}

/// Walks the list of [`for_each_backend_op!`], sorting each op by its result.
#[doc(hidden)]
#[macro_export]
macro_rules! __backend_ops {
    ($m:ident) => {};
    ($m:ident fn $name:ident $p:tt -> Result<Self::Buf>; $($rest:tt)*) => {
        $m! { $name $p [buf] [-> $crate::Result<Self::Buf>] }
        $crate::__backend_ops! { $m $($rest)* }
    };
    ($m:ident fn $name:ident $p:tt -> Result<Self::Mat>; $($rest:tt)*) => {
        $m! { $name $p [mat] [-> $crate::Result<Self::Mat>] }
        $crate::__backend_ops! { $m $($rest)* }
    };
    ($m:ident fn $name:ident $p:tt -> Result<Self::Mark>; $($rest:tt)*) => {
        $m! { $name $p [mark] [-> $crate::Result<Self::Mark>] }
        $crate::__backend_ops! { $m $($rest)* }
    };
    ($m:ident fn $name:ident $p:tt -> Result<$t:ty>; $($rest:tt)*) => {
        $m! { $name $p [result] [-> $crate::Result<$t>] }
        $crate::__backend_ops! { $m $($rest)* }
    };
    ($m:ident fn $name:ident $p:tt -> $t:ty; $($rest:tt)*) => {
        $m! { $name $p [value] [-> $t] }
        $crate::__backend_ops! { $m $($rest)* }
    };
    ($m:ident fn $name:ident $p:tt; $($rest:tt)*) => {
        $m! { $name $p [value] [] }
        $crate::__backend_ops! { $m $($rest)* }
    };
}

/// Sorts one op's parameters by kind (`buf`, `buf_mut`, `mat`, `mark`, `value`) and hands the
/// op to the forwarder: `forwarder! { args.. name (params) [kind] [-> return] [(kind param)..] }`.
#[doc(hidden)]
#[macro_export]
macro_rules! __backend_op {
    (@ $fw:tt $arg:tt $name:ident $p:tt $k:tt $r:tt [$($a:tt)*] $x:ident: &Self::Buf $(, $($rest:tt)*)?) => {
        $crate::__backend_op! { @ $fw $arg $name $p $k $r [$($a)* (buf $x)] $($($rest)*)? }
    };
    (@ $fw:tt $arg:tt $name:ident $p:tt $k:tt $r:tt [$($a:tt)*] $x:ident: &mut Self::Buf $(, $($rest:tt)*)?) => {
        $crate::__backend_op! { @ $fw $arg $name $p $k $r [$($a)* (buf_mut $x)] $($($rest)*)? }
    };
    (@ $fw:tt $arg:tt $name:ident $p:tt $k:tt $r:tt [$($a:tt)*] $x:ident: &Self::Mat $(, $($rest:tt)*)?) => {
        $crate::__backend_op! { @ $fw $arg $name $p $k $r [$($a)* (mat $x)] $($($rest)*)? }
    };
    (@ $fw:tt $arg:tt $name:ident $p:tt $k:tt $r:tt [$($a:tt)*] $x:ident: &Self::Mark $(, $($rest:tt)*)?) => {
        $crate::__backend_op! { @ $fw $arg $name $p $k $r [$($a)* (mark $x)] $($($rest)*)? }
    };
    (@ $fw:tt $arg:tt $name:ident $p:tt $k:tt $r:tt [$($a:tt)*] $x:ident: $t:ty $(, $($rest:tt)*)?) => {
        $crate::__backend_op! { @ $fw $arg $name $p $k $r [$($a)* (value $x)] $($($rest)*)? }
    };
    (@ [$($fw:tt)+] [$($arg:tt)*] $name:ident $p:tt $k:tt $r:tt $a:tt) => {
        $($fw)+! { $($arg)* $name $p $k $r $a }
    };
    ($fw:tt $arg:tt $name:ident ($($p:tt)*) $k:tt $r:tt) => {
        $crate::__backend_op! { @ $fw $arg $name ($($p)*) $k $r [] $($p)* }
    };
}

/// The forwarder of [`forward_backend!`]: the op as the inner backend's.
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_wrapped {
    (@arg $w:ty, buf $x:ident) => {
        <$w as $crate::Wrapper>::buf($x)
    };
    (@arg $w:ty, buf_mut $x:ident) => {
        <$w as $crate::Wrapper>::buf_mut($x)
    };
    (@arg $w:ty, $kind:ident $x:ident) => {
        $x
    };
    ($w:ty; $name:ident ($($p:tt)*) [buf] [$($ret:tt)*] [$(($kind:ident $x:ident))*]) => {
        fn $name(&self, $($p)*) $($ret)* {
            let made = <<$w as $crate::Wrapper>::Inner as $crate::Backend>::$name(
                $crate::Wrapper::inner(self),
                $($crate::__forward_wrapped!(@arg $w, $kind $x)),*
            )?;
            $crate::Wrapper::adopt(self, made)
        }
    };
    ($w:ty; $name:ident ($($p:tt)*) $k:tt [$($ret:tt)*] [$(($kind:ident $x:ident))*]) => {
        fn $name(&self, $($p)*) $($ret)* {
            <<$w as $crate::Wrapper>::Inner as $crate::Backend>::$name(
                $crate::Wrapper::inner(self),
                $($crate::__forward_wrapped!(@arg $w, $kind $x)),*
            )
        }
    };
}

#[cfg(test)]
mod tests {
    use crate::{Backend, Cpu, DType, HostBuf, Result, Wrapper};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The list names every method of the trait, once: a method missing from it would be
    /// left to the trait's default (or fail to build) in every forwarding backend.
    #[test]
    fn the_op_list_is_the_trait() {
        let mut listed: Vec<&str> = Vec::new();
        macro_rules! collect {
            ($name:ident $($rest:tt)*) => {
                listed.push(stringify!($name));
            };
        }
        crate::for_each_backend_op!(collect);
        let src = include_str!("../backend.rs");
        let start = src.find("pub trait Backend").expect("the trait");
        let body = &src[start..start + src[start..].find("\n}\n").expect("its end")];
        let mut declared: Vec<&str> = body
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("fn "))
            .filter_map(|l| l.split(['(', '<']).next())
            .collect();
        declared.sort_unstable();
        let n = listed.len();
        listed.sort_unstable();
        listed.dedup();
        assert_eq!(listed.len(), n, "an op listed twice");
        assert_eq!(listed, declared);
    }

    /// A wrapper with buffers of its own: counts the buffers it adopts and its additions.
    #[derive(Default)]
    struct Tally {
        adopted: AtomicUsize,
        adds: AtomicUsize,
    }
    struct Boxed(HostBuf);

    impl Wrapper for Tally {
        type Inner = Cpu;
        fn inner(&self) -> &Cpu {
            &Cpu
        }
        fn buf(buf: &Boxed) -> &HostBuf {
            &buf.0
        }
        fn buf_mut(buf: &mut Boxed) -> &mut HostBuf {
            &mut buf.0
        }
        fn adopt(&self, buf: HostBuf) -> Result<Boxed> {
            self.adopted.fetch_add(1, Ordering::SeqCst);
            Ok(Boxed(buf))
        }
    }

    crate::forward_backend! {
        impl Backend for Tally {
            type Buf = Boxed;
            defaults(duplicate, download_many, upload_many);
            fn name(&self) -> &'static str {
                "tally"
            }
            fn add_assign(&self, x: &mut Boxed, y: &Boxed) -> Result<()> {
                self.adds.fetch_add(1, Ordering::SeqCst);
                Cpu.add_assign(&mut x.0, &y.0)
            }
        }
    }

    #[test]
    fn a_wrapper_runs_what_it_does_not_write_on_the_inner_backend() {
        let t = Tally::default();
        assert_eq!(t.name(), "tally");
        let mut x = t.upload(&[1.0, 2.0]).unwrap();
        let y = t.zeros_as(2, DType::F32).unwrap();
        assert_eq!(t.adopted.load(Ordering::SeqCst), 2, "upload and zeros_as adopt what the CPU made");
        t.add_assign(&mut x, &y).unwrap();
        assert_eq!(t.adds.load(Ordering::SeqCst), 1, "the written op runs");
        assert_eq!((t.len(&x), t.dtype(&x), t.bytes(&x)), (2, DType::F32, 8));
        // `duplicate` is the trait's default: zeros_as (adopted) then copy_columns.
        let d = t.duplicate(&x).unwrap();
        assert_eq!(t.adopted.load(Ordering::SeqCst), 3);
        assert_eq!(t.download(&d).unwrap(), vec![1.0, 2.0]);
        assert!(t.memory().is_some(), "memory is the CPU's");
        assert_eq!(t.weight_dtype(), DType::F32);
    }
}
