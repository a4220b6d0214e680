//! One architecture's way from an image to its output. A network states its input as a
//! [`Preprocess`] recipe instead of resizing on its own, so the image store computes each
//! (image, recipe) once and shares it: `classify_chest_xray` and `localize_finding` on the same
//! radiograph resize it once, as do `segment_lungs` and `measure_chest`. The backend is the
//! runner's own (chosen when it is loaded); postprocessing that needs the original image (masks
//! at full size, boxes) stays with the tool, which holds the recipe's [`Prepared::geometry`].

use hilum_imaging::{prepare_values, Prepared, Preprocess};

use crate::ModelError;

/// An architecture loaded for inference: the input it takes and how to run it on one image.
pub trait Runner {
    /// What one run gives (probabilities, a mask, ...).
    type Output;

    /// The input this network takes (`ImageStore::prepared(id, &runner.recipe())`).
    fn recipe(&self) -> Preprocess;

    /// Runs the network on one input made by [`Runner::recipe`].
    fn run(&self, input: &Prepared) -> Result<Self::Output, ModelError>;
}

/// An input that was not made by `recipe` (another size, channel count or layout) is refused
/// before it reaches a network that would misread it.
pub(crate) fn check_input(recipe: &Preprocess, input: &Prepared) -> Result<(), ModelError> {
    if input.width != recipe.width
        || input.height != recipe.height
        || input.channels != recipe.channels
        || input.layout != recipe.layout
    {
        return Err(ModelError::Compute(format!(
            "model input is {}x{}x{} ({:?}), the model takes {}x{}x{} ({:?})",
            input.width,
            input.height,
            input.channels,
            input.layout,
            recipe.width,
            recipe.height,
            recipe.channels,
            recipe.layout
        )));
    }
    Ok(())
}

/// A recipe on a bare luminance plane (`width * height` values, full scale `max_value`), for
/// callers outside an image store (fixtures, batch benchmarks): the model's input values, or
/// nothing when the plane does not match its size (the network then refuses the empty input).
pub(crate) fn recipe_values(
    recipe: &Preprocess,
    values: &[f32],
    width: usize,
    height: usize,
    max_value: f32,
) -> Vec<f32> {
    prepare_values(values, width as u32, height as u32, max_value, recipe)
        .map(|p| p.data)
        .unwrap_or_default()
}
