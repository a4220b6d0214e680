//! Hilum umbrella package: re-exports the workspace crates for end-to-end tests and benches.
pub use hilum_agent as agent;
pub use hilum_llm as llm;
pub use hilum_llm_local as llm_local;
pub use hilum_tools as tools;
