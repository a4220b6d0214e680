//! How a program adds a tool to Hilum: the tool is one file ([`intensity_at`]) and the program
//! registers it with one line (`src/main.rs`). The tests check that it is listed with its
//! generated schema, that the agent rejects arguments breaking that schema, and that a local
//! model is offered it only when its declared requirement holds.

pub mod intensity_at;
