//! `hilum-example`: the `hilum` command with one more tool; the registration is the one line.

use hilum_tool_example::intensity_at::IntensityAt;

fn main() {
    hilum_cli::main_with(hilum_tools::Registry::builtin().with::<IntensityAt>());
}
