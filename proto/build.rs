//! Compiles the .proto files with protox (pure Rust), so building needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/client.proto", "proto/agent.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        // The generated AgentServiceClient::connect RPC would clash with the
        // transport constructor of the same name; clients are built from a Channel.
        .build_transport(false)
        // Payloads stay reference-counted from decode to socket write.
        .bytes(".")
        // Small per-stream buffers (see src/codec.rs).
        .codec_path("crate::codec::LeanCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
