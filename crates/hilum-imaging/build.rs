//! Compiles src/jpeg_shim.c against the libjpeg-turbo headers that `mozjpeg-sys` builds (it
//! declares `links = "jpeg"`, so cargo hands its include folders over as DEP_JPEG_INCLUDE).

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/jpeg_shim.c");
    println!("cargo:rerun-if-env-changed=DEP_JPEG_INCLUDE");
    let Some(include) = env::var_os("DEP_JPEG_INCLUDE") else {
        // Only reachable if mozjpeg-sys stops exporting its headers: say so instead of
        // failing later on a missing jpeglib.h.
        eprintln!("hilum-imaging: DEP_JPEG_INCLUDE is not set (mozjpeg-sys headers not found)");
        std::process::exit(1);
    };
    let mut build = cc::Build::new();
    build.file("src/jpeg_shim.c");
    for dir in env::split_paths(&include) {
        build.include::<PathBuf>(dir);
    }
    build.warnings(true);
    build.compile("hilum_jpeg_shim");
}
