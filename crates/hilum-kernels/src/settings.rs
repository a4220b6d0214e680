//! The CPU engines' settings. This crate reads no environment variables: the program builds a
//! [`CpuSettings`] and hands it down. [`CpuSettings::from_vars`] maps the documented variable
//! names onto it from a lookup the program gives (Hilum's CLI passes its environment), so every
//! program and benchmark spells them the same way and the mapping is tested without touching
//! the process's environment.
//!
//! `threads` belongs to each network and is passed to its constructor
//! (`NativeDenseNet::new(.., settings.threads())`). The other fields are process-wide, set by
//! [`configure`] at start-up, before the first network is built: they are measurement knobs
//! read inside every forward pass (tile size, images per pass, profile) or choices that must be
//! the same for every network a process compares (instruction set, U-Net engine), and passing
//! them to every plan would add a parameter to each constructor for values that never differ
//! within one process. Without a call to [`configure`] they keep their defaults.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// Floats per gathered tile by default: 2^16 (256 KiB).
const DEFAULT_TILE_FLOATS: usize = 1 << 16;
/// Smallest accepted tile: below it the per-tile overhead dominates.
const MIN_TILE_FLOATS: usize = 1024;
/// Images per pass of a large DenseNet batch by default (224 px, batch 16, 2 threads: 187 ms at
/// 4 per pass, 193 ms one at a time, 205 ms all 16).
const DEFAULT_IMAGES_PER_PASS: usize = 4;

/// Which engine runs the lung U-Net.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnetEngine {
    /// The direct kernels on x86-64 with AVX2 or AVX-512, else the im2col + gemm plan.
    #[default]
    Auto,
    /// The direct kernels (`HILUM_UNET_ENGINE=direct`).
    Direct,
    /// The im2col + gemm plan (`HILUM_UNET_ENGINE=gemm`).
    Gemm,
}

/// The widest instruction set the U-Net's direct kernels may use (to compare them on one
/// machine); what the CPU lacks is never used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaCap {
    /// The portable kernels, without AVX2 or AVX-512 (`HILUM_UNET_ISA=portable`).
    Portable,
    /// AVX2 at most, even on AVX-512 CPUs (`HILUM_UNET_ISA=avx2`).
    Avx2,
    /// AVX-512 where the CPU has it.
    #[default]
    Best,
}

/// Timing of every op of a forward pass, printed on stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    /// No timing.
    #[default]
    Off,
    /// Per kind of op.
    Ops,
    /// Per kind of op and output size.
    OpsBySize,
}

/// What the CPU engines may be told; `Default` is the tuned behaviour on all cores.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuSettings {
    /// Worker threads per network; `None` (or 0): all cores.
    pub threads: Option<usize>,
    /// Floats per gathered tile; `None`: 2^16. Values below 1024 are ignored.
    pub tile_floats: Option<usize>,
    /// Images per pass of a large DenseNet batch; `None` (or 0): 4.
    pub images_per_pass: Option<usize>,
    /// Which engine runs the lung U-Net.
    pub unet_engine: UnetEngine,
    /// Widest instruction set the U-Net's direct kernels may use.
    pub unet_isa: IsaCap,
    /// Whether to time each op of a forward pass.
    pub profile: Profile,
}

impl CpuSettings {
    /// The settings named by variables, looked up with `var`: `HILUM_CPU_THREADS`,
    /// `HILUM_CPU_TILE_FLOATS`, `HILUM_CPU_IMAGES_PER_PASS` (numbers; others are ignored),
    /// `HILUM_UNET_ENGINE=direct|gemm`, `HILUM_UNET_ISA=avx2|portable` (other values: the
    /// default) and `HILUM_CPU_PROFILE` (set: per kind of op; `2`: per output size too).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let number = |k: &str| var(k).and_then(|v| v.parse::<usize>().ok());
        CpuSettings {
            threads: number("HILUM_CPU_THREADS").filter(|&n| n > 0),
            tile_floats: number("HILUM_CPU_TILE_FLOATS").filter(|&n| n >= MIN_TILE_FLOATS),
            images_per_pass: number("HILUM_CPU_IMAGES_PER_PASS").filter(|&n| n >= 1),
            unet_engine: match var("HILUM_UNET_ENGINE").as_deref() {
                Some("direct") => UnetEngine::Direct,
                Some("gemm") => UnetEngine::Gemm,
                _ => UnetEngine::Auto,
            },
            unet_isa: match var("HILUM_UNET_ISA").as_deref() {
                Some("portable") => IsaCap::Portable,
                Some("avx2") => IsaCap::Avx2,
                _ => IsaCap::Best,
            },
            profile: match var("HILUM_CPU_PROFILE").as_deref() {
                None => Profile::Off,
                Some("2") => Profile::OpsBySize,
                Some(_) => Profile::Ops,
            },
        }
    }

    /// The worker threads a network gets.
    pub fn threads(&self) -> usize {
        self.threads.filter(|&n| n > 0).unwrap_or_else(all_cores)
    }
}

/// The cores this process may use (1 when unknown).
pub fn all_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

static TILE_FLOATS: AtomicUsize = AtomicUsize::new(DEFAULT_TILE_FLOATS);
static IMAGES_PER_PASS: AtomicUsize = AtomicUsize::new(DEFAULT_IMAGES_PER_PASS);
static UNET_ENGINE: AtomicU8 = AtomicU8::new(0);
static UNET_ISA: AtomicU8 = AtomicU8::new(2);
static PROFILE: AtomicU8 = AtomicU8::new(0);

/// Sets the process-wide knobs of `settings` (all but `threads`). Call it once at start-up; a
/// later call (a benchmark turning the profile on) affects the forward passes that follow,
/// not the networks already built.
pub fn configure(settings: &CpuSettings) {
    let tile = settings
        .tile_floats
        .filter(|&n| n >= MIN_TILE_FLOATS)
        .unwrap_or(DEFAULT_TILE_FLOATS);
    TILE_FLOATS.store(tile, Ordering::Relaxed);
    let per_pass = settings
        .images_per_pass
        .filter(|&n| n >= 1)
        .unwrap_or(DEFAULT_IMAGES_PER_PASS);
    IMAGES_PER_PASS.store(per_pass, Ordering::Relaxed);
    let engine = match settings.unet_engine {
        UnetEngine::Auto => 0,
        UnetEngine::Direct => 1,
        UnetEngine::Gemm => 2,
    };
    UNET_ENGINE.store(engine, Ordering::Relaxed);
    let isa = match settings.unet_isa {
        IsaCap::Portable => 0,
        IsaCap::Avx2 => 1,
        IsaCap::Best => 2,
    };
    UNET_ISA.store(isa, Ordering::Relaxed);
    set_profile(settings.profile);
}

/// Turns the per-op timing on or off for the forward passes that follow.
pub fn set_profile(profile: Profile) {
    let p = match profile {
        Profile::Off => 0,
        Profile::Ops => 1,
        Profile::OpsBySize => 2,
    };
    PROFILE.store(p, Ordering::Relaxed);
}

pub(crate) fn tile_floats() -> usize {
    TILE_FLOATS.load(Ordering::Relaxed)
}

pub(crate) fn images_per_pass() -> usize {
    IMAGES_PER_PASS.load(Ordering::Relaxed)
}

pub(crate) fn unet_engine() -> UnetEngine {
    match UNET_ENGINE.load(Ordering::Relaxed) {
        1 => UnetEngine::Direct,
        2 => UnetEngine::Gemm,
        _ => UnetEngine::Auto,
    }
}

pub(crate) fn unet_isa() -> IsaCap {
    match UNET_ISA.load(Ordering::Relaxed) {
        0 => IsaCap::Portable,
        1 => IsaCap::Avx2,
        _ => IsaCap::Best,
    }
}

pub(crate) fn profile() -> Profile {
    match PROFILE.load(Ordering::Relaxed) {
        1 => Profile::Ops,
        2 => Profile::OpsBySize,
        _ => Profile::Off,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_default_to_all_cores_and_zero_means_default() {
        assert_eq!(CpuSettings::default().threads(), all_cores());
        let zero = CpuSettings {
            threads: Some(0),
            ..Default::default()
        };
        assert_eq!(zero.threads(), all_cores());
        let two = CpuSettings {
            threads: Some(2),
            ..Default::default()
        };
        assert_eq!(two.threads(), 2);
    }

    #[test]
    fn variables_map_onto_settings_and_bad_values_keep_defaults() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(CpuSettings::from_vars(|_| None), CpuSettings::default());
        let s = CpuSettings::from_vars(vars(&[
            ("HILUM_CPU_THREADS", "3"),
            ("HILUM_CPU_TILE_FLOATS", "4096"),
            ("HILUM_CPU_IMAGES_PER_PASS", "2"),
            ("HILUM_UNET_ENGINE", "gemm"),
            ("HILUM_UNET_ISA", "avx2"),
            ("HILUM_CPU_PROFILE", "2"),
        ]));
        assert_eq!(s.threads(), 3);
        assert_eq!(s.tile_floats, Some(4096));
        assert_eq!(s.images_per_pass, Some(2));
        assert_eq!(s.unet_engine, UnetEngine::Gemm);
        assert_eq!(s.unet_isa, IsaCap::Avx2);
        assert_eq!(s.profile, Profile::OpsBySize);
        let bad = CpuSettings::from_vars(vars(&[
            ("HILUM_CPU_THREADS", "many"),
            ("HILUM_CPU_TILE_FLOATS", "16"),
            ("HILUM_UNET_ENGINE", "fast"),
            ("HILUM_CPU_PROFILE", ""),
        ]));
        assert_eq!(bad.threads, None);
        assert_eq!(bad.tile_floats, None);
        assert_eq!(bad.unet_engine, UnetEngine::Auto);
        // Set, even empty, turns the profile on (as it always has).
        assert_eq!(bad.profile, Profile::Ops);
    }
}
