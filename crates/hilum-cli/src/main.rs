//! `hilum`: chest X-ray analysis with tools and a reasoning model.

fn main() {
    hilum_cli::main_with(hilum_tools::Registry::builtin());
}
