//go:build grpc
// +build grpc

// The null gRPC server: grpc-go serving ProxyService on a Unix socket and
// answering by itself, with no agent and no target behind it: a DIAL_REQ
// with its DIAL_RSP, each DATA with the same bytes back, CLOSE_REQ by
// ending the stream. What the Go gRPC client measures against it is
// grpc-go's own cost of a single-use tunnel, client and server, with no
// hop at all: the ceiling of any gRPC frontend for that client, beside
// which our gRPC and CONNECT figures are read.

package main

import (
	"flag"
	"fmt"
	"net"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
)

var nullSocket = flag.String("serve-null-grpc", "", "serve the null gRPC server on this Unix socket until killed")

// String makes rawCodec a grpc.Codec for the server side (grpc-go 1.33).
func (rawCodec) String() string { return "proto" }

func init() {
	serveNull = func() bool {
		if *nullSocket == "" {
			return false
		}
		_ = os.Remove(*nullSocket)
		listener, err := net.Listen("unix", *nullSocket)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		server := grpc.NewServer(grpc.CustomCodec(rawCodec{}), grpc.UnknownServiceHandler(answerAlone))
		if err := server.Serve(listener); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return true
	}
}

// answerAlone answers one Proxy stream without dialing anything.
func answerAlone(_ interface{}, stream grpc.ServerStream) error {
	for {
		var raw []byte
		if err := stream.RecvMsg(&raw); err != nil {
			return nil
		}
		packet, err := parsePacket(raw)
		if err != nil {
			return err
		}
		var body []byte
		switch packet.kind {
		case dialReq:
			body = protowire.AppendTag(body, 2, protowire.VarintType) // connectID
			body = protowire.AppendVarint(body, 1)
			body = protowire.AppendTag(body, 3, protowire.VarintType) // random
			body = protowire.AppendVarint(body, uint64(packet.random))
			err = stream.SendMsg(packetWith(dialRsp, 3, body))
		case dataPkt:
			body = protowire.AppendTag(body, 1, protowire.VarintType) // connectID
			body = protowire.AppendVarint(body, 1)
			body = protowire.AppendTag(body, 3, protowire.BytesType) // data
			body = protowire.AppendBytes(body, packet.payload)
			err = stream.SendMsg(packetWith(dataPkt, 4, body))
		case closeReq:
			return nil
		}
		if err != nil {
			return err
		}
	}
}
