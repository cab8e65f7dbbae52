//! Shared test fixtures: tollgate in-process, real processes (Envoy, the tollgate binary, the
//! example upstream) through the test kit (`testkit/`, shared with the examples), and a
//! scripted ext_proc client.

pub mod envoy;
pub mod process;
pub mod recorder;
pub mod recording;
pub mod server;
