//! The single integration-test binary: gRPC against the server on port 0, and end to end
//! through real Envoy, the tollgate binary and the example upstream.

mod budgets;
mod cli;
mod control;
mod deploy;
mod e2e;
mod envoy_config;
mod fleet;
mod fleet_store;
mod grpc;
mod lab;
mod operate;
mod queue;
mod redis_store;
mod replay;
mod replicas;
mod robustness;
mod store_contract;
mod support;
mod tokenizers;
