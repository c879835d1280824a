//! Tensor bulk copies (`cp.async.bulk.tensor`) and reductions (`cp.reduce.async.bulk.tensor`), tile
//! mode, 1 to 5 dimensions.
//!
//! The tensor map (`CUtensorMap`, 128 bytes, 64-byte aligned) is built on the host and copied to global
//! memory before the launch; the instructions take its generic address. Coordinates are signed element
//! indices of the box's first element, innermost dimension first. Out-of-bounds box elements are
//! zero-filled on loads and skipped on stores and reductions.

use crate::{Global, Mbarrier, Shared, TensorMap};
use core::arch::asm;

macro_rules! tensor_family {
    (
        $dims:literal,
        $load:ident, $store:ident, $add:ident, $min:ident, $max:ident,
        ($($c:ident),+), $coords:literal, $ops:literal
    ) => {
        #[doc = concat!("Loads one ", $dims, "-D box described by `map` at the given coordinates into this CTA's shared memory, completing `box bytes` transaction bytes on `bar`.")]
        ///
        #[doc = concat!("`cp.async.bulk.tensor.", $dims, "d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [tensorMap, {", $coords, "}], [mbar];` · PTX ISA 8.0 · sm_90")]
        ///
        /// # Safety
        /// - `map` addresses a valid tensor map in global memory, written before the launch (or published
        ///   to the async proxy with `fence.proxy.tensormap::generic`), describing readable memory.
        /// - `dst` is 128-byte aligned, in this CTA's shared memory, with room for the map's box.
        /// - `bar` is live and its current phase expects the box's byte count; `dst` may be read only
        ///   after that phase completes.
        #[doc(alias = "cp.async.bulk.tensor")]
        #[inline(always)]
        pub unsafe fn $load(dst: Shared<u8>, map: Global<TensorMap>, $($c: i32,)+ bar: Shared<Mbarrier>) {
            // SAFETY: the caller guarantees the map, the destination and the barrier (see `# Safety`).
            unsafe {
                asm!(
                    concat!("cp.async.bulk.tensor.", $dims, "d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{", $ops, "}}], [{b}];"),
                    d = in(reg32) dst.addr(),
                    m = in(reg64) map.addr(),
                    b = in(reg32) bar.addr(),
                    $($c = in(reg32) $c,)+
                )
            }
        }

        #[doc = concat!("Stores one ", $dims, "-D box from this CTA's shared memory to the tensor `map` describes, in the current bulk group.")]
        ///
        #[doc = concat!("`cp.async.bulk.tensor.", $dims, "d.global.shared::cta.tile.bulk_group [tensorMap, {", $coords, "}], [src];` · PTX ISA 8.0 · sm_90")]
        ///
        /// # Safety
        /// - `map` as for the load; the memory it describes is writable.
        /// - `src` is 128-byte aligned and holds a box completely written before the store (see
        ///   `cp_async_bulk_global_shared_bulk_group`); it must not be overwritten before
        ///   `cp.async.bulk.wait_group.read` covers this group, and the writes are complete only after
        ///   `cp.async.bulk.wait_group`.
        #[doc(alias = "cp.async.bulk.tensor")]
        #[inline(always)]
        pub unsafe fn $store(map: Global<TensorMap>, $($c: i32,)+ src: Shared<u8>) {
            // SAFETY: the caller guarantees the map, the source and completion handling.
            unsafe {
                asm!(
                    concat!("cp.async.bulk.tensor.", $dims, "d.global.shared::cta.tile.bulk_group [{m}, {{", $ops, "}}], [{s}];"),
                    m = in(reg64) map.addr(),
                    s = in(reg32) src.addr(),
                    $($c = in(reg32) $c,)+
                )
            }
        }

        tensor_family!(@reduce $dims, $add, "add", ($($c),+), $coords, $ops);
        tensor_family!(@reduce $dims, $min, "min", ($($c),+), $coords, $ops);
        tensor_family!(@reduce $dims, $max, "max", ($($c),+), $coords, $ops);
    };

    (@reduce $dims:literal, $name:ident, $op:literal, ($($c:ident),+), $coords:literal, $ops:literal) => {
        #[doc = concat!("Reduces (", $op, ") one ", $dims, "-D box from this CTA's shared memory into the tensor `map` describes, element type taken from the map, in the current bulk group.")]
        ///
        #[doc = concat!("`cp.reduce.async.bulk.tensor.", $dims, "d.global.shared::cta.", $op, ".tile.bulk_group [tensorMap, {", $coords, "}], [src];` · PTX ISA 8.0 · sm_90")]
        ///
        /// # Safety
        /// As the tile store of the same dimension; the map's element type must support this operation
        /// (add: f32, f16, bf16, u32, s32, u64; min/max: u32, s32, u64, s64, f16, bf16).
        #[doc(alias = "cp.reduce.async.bulk.tensor")]
        #[inline(always)]
        pub unsafe fn $name(map: Global<TensorMap>, $($c: i32,)+ src: Shared<u8>) {
            // SAFETY: the caller guarantees the map, the source, the element type and completion handling.
            unsafe {
                asm!(
                    concat!("cp.reduce.async.bulk.tensor.", $dims, "d.global.shared::cta.", $op, ".tile.bulk_group [{m}, {{", $ops, "}}], [{s}];"),
                    m = in(reg64) map.addr(),
                    s = in(reg32) src.addr(),
                    $($c = in(reg32) $c,)+
                )
            }
        }
    };

}

tensor_family!(
    1,
    cp_async_bulk_tensor_1d_shared_global_tile_mbarrier,
    cp_async_bulk_tensor_1d_global_shared_tile_bulk_group,
    cp_reduce_async_bulk_tensor_1d_global_shared_add_tile_bulk_group,
    cp_reduce_async_bulk_tensor_1d_global_shared_min_tile_bulk_group,
    cp_reduce_async_bulk_tensor_1d_global_shared_max_tile_bulk_group,
    (c0),
    "c0",
    "{c0}"
);
tensor_family!(
    2,
    cp_async_bulk_tensor_2d_shared_global_tile_mbarrier,
    cp_async_bulk_tensor_2d_global_shared_tile_bulk_group,
    cp_reduce_async_bulk_tensor_2d_global_shared_add_tile_bulk_group,
    cp_reduce_async_bulk_tensor_2d_global_shared_min_tile_bulk_group,
    cp_reduce_async_bulk_tensor_2d_global_shared_max_tile_bulk_group,
    (c0, c1),
    "c0, c1",
    "{c0}, {c1}"
);
tensor_family!(
    3,
    cp_async_bulk_tensor_3d_shared_global_tile_mbarrier,
    cp_async_bulk_tensor_3d_global_shared_tile_bulk_group,
    cp_reduce_async_bulk_tensor_3d_global_shared_add_tile_bulk_group,
    cp_reduce_async_bulk_tensor_3d_global_shared_min_tile_bulk_group,
    cp_reduce_async_bulk_tensor_3d_global_shared_max_tile_bulk_group,
    (c0, c1, c2),
    "c0, c1, c2",
    "{c0}, {c1}, {c2}"
);
tensor_family!(
    4,
    cp_async_bulk_tensor_4d_shared_global_tile_mbarrier,
    cp_async_bulk_tensor_4d_global_shared_tile_bulk_group,
    cp_reduce_async_bulk_tensor_4d_global_shared_add_tile_bulk_group,
    cp_reduce_async_bulk_tensor_4d_global_shared_min_tile_bulk_group,
    cp_reduce_async_bulk_tensor_4d_global_shared_max_tile_bulk_group,
    (c0, c1, c2, c3),
    "c0, c1, c2, c3",
    "{c0}, {c1}, {c2}, {c3}"
);
tensor_family!(
    5,
    cp_async_bulk_tensor_5d_shared_global_tile_mbarrier,
    cp_async_bulk_tensor_5d_global_shared_tile_bulk_group,
    cp_reduce_async_bulk_tensor_5d_global_shared_add_tile_bulk_group,
    cp_reduce_async_bulk_tensor_5d_global_shared_min_tile_bulk_group,
    cp_reduce_async_bulk_tensor_5d_global_shared_max_tile_bulk_group,
    (c0, c1, c2, c3, c4),
    "c0, c1, c2, c3, c4",
    "{c0}, {c1}, {c2}, {c3}, {c4}"
);
