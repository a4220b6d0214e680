//! Injected forward-pass failures ([`ModelSettings::forward_faults`](crate::ModelSettings)):
//! [`ModelPool::run_on`](crate::ModelPool::run_on) arms the thread that runs a call's work on
//! a listed device, and the forward passes that check ([`check`]) fail there with a device
//! error, as a GPU that ran out of memory would. The failure starts inside the model, so a test
//! sees whether the tool around it hands a device failure back to the pool.

use std::cell::Cell;

use crate::{Device, ModelError};

thread_local! {
    static ARMED: Cell<Option<Device>> = const { Cell::new(None) };
}

/// Arms this thread for `device` (`None`: leaves it unarmed) until the guard drops.
pub(crate) fn arm(device: Option<Device>) -> Armed {
    Armed(ARMED.replace(device))
}

pub(crate) struct Armed(Option<Device>);

impl Drop for Armed {
    fn drop(&mut self) {
        ARMED.set(self.0);
    }
}

/// At the start of a forward pass: the injected failure, if this thread is armed.
pub(crate) fn check() -> Result<(), ModelError> {
    match ARMED.get() {
        Some(d) => Err(ModelError::Device {
            device: d.to_string(),
            reason: "injected forward-pass failure (ModelSettings::forward_faults)".into(),
        }),
        None => Ok(()),
    }
}
