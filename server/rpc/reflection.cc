#include "server/rpc/reflection.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "attnserve/v1/server_config.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/health/v1/health.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/engine/client_text.h"

namespace attn {
namespace {

namespace pb = google::protobuf;

// Adds `file` and, before it, every file it imports (transitively), each once.
void AddWithDependencies(const pb::FileDescriptor* file,
                         absl::flat_hash_set<const pb::FileDescriptor*>& added,
                         std::vector<std::string>& out) {
  if (!added.insert(file).second) return;
  for (int i = 0; i < file->dependency_count(); ++i) {
    AddWithDependencies(file->dependency(i), added, out);
  }
  pb::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out.push_back(proto.SerializeAsString());
}

// Answers one request. The message types of v1 and v1alpha are distinct but field for field the
// same, so one template serves both.
template <typename Request, typename Response>
void Answer(const Request& req, const std::vector<std::string>& services, Response* resp) {
  const pb::DescriptorPool* pool = pb::DescriptorPool::generated_pool();
  resp->set_valid_host(req.host());
  *resp->mutable_original_request() = req;
  const pb::FileDescriptor* file = nullptr;
  std::string missing;
  switch (req.message_request_case()) {
    case Request::kFileByFilename:
      file = pool->FindFileByName(req.file_by_filename());
      missing = absl::StrCat("file ", ShownClientString(req.file_by_filename()));
      break;
    case Request::kFileContainingSymbol:
      file = pool->FindFileContainingSymbol(req.file_containing_symbol());
      missing = absl::StrCat("symbol ", ShownClientString(req.file_containing_symbol()));
      break;
    case Request::kFileContainingExtension: {
      const auto& ext = req.file_containing_extension();
      const pb::Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
      const pb::FieldDescriptor* field =
          type ? pool->FindExtensionByNumber(type, ext.extension_number()) : nullptr;
      if (field != nullptr) file = field->file();
      missing = absl::StrCat("extension ", ext.extension_number(), " of ",
                             ShownClientString(ext.containing_type()));
      break;
    }
    case Request::kAllExtensionNumbersOfType: {
      const pb::Descriptor* type = pool->FindMessageTypeByName(req.all_extension_numbers_of_type());
      if (type == nullptr) {
        missing = absl::StrCat("type ", ShownClientString(req.all_extension_numbers_of_type()));
        break;
      }
      std::vector<const pb::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      auto* numbers = resp->mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const pb::FieldDescriptor* f : extensions) numbers->add_extension_number(f->number());
      return;
    }
    case Request::kListServices:
      for (const std::string& name : services) {
        resp->mutable_list_services_response()->add_service()->set_name(name);
      }
      return;
    default:
      resp->mutable_error_response()->set_error_code(
          static_cast<int>(grpc::StatusCode::UNIMPLEMENTED));
      resp->mutable_error_response()->set_error_message("the request names no known question");
      return;
  }
  if (file == nullptr) {
    resp->mutable_error_response()->set_error_code(static_cast<int>(grpc::StatusCode::NOT_FOUND));
    resp->mutable_error_response()->set_error_message(absl::StrCat(missing, " is not known"));
    return;
  }
  std::vector<std::string> files;
  absl::flat_hash_set<const pb::FileDescriptor*> added;
  AddWithDependencies(file, added, files);
  auto* out = resp->mutable_file_descriptor_response();
  for (std::string& f : files) out->add_file_descriptor_proto(std::move(f));
}

// The service of one package: Service is its generated base class.
template <typename Service, typename Request, typename Response>
class ReflectionService final : public Service {
 public:
  explicit ReflectionService(const std::vector<std::string>* services) : services_(services) {}

  grpc::Status ServerReflectionInfo(grpc::ServerContext*,
                                    grpc::ServerReaderWriter<Response, Request>* stream) override {
    Request req;
    while (stream->Read(&req)) {
      Response resp;
      Answer(req, *services_, &resp);
      if (!stream->Write(resp)) break;
    }
    return grpc::Status::OK;
  }

 private:
  const std::vector<std::string>* services_;
};

namespace rv1 = grpc::reflection::v1;
namespace rv1alpha = grpc::reflection::v1alpha;
using V1 = ReflectionService<rv1::ServerReflection::Service, rv1::ServerReflectionRequest,
                             rv1::ServerReflectionResponse>;
using V1Alpha =
    ReflectionService<rv1alpha::ServerReflection::Service, rv1alpha::ServerReflectionRequest,
                      rv1alpha::ServerReflectionResponse>;

// The names list_services answers. Touching the descriptors of the files reflection describes
// keeps their generated code (and so their descriptors) linked into the binary.
std::vector<std::string> WithReflection(std::vector<std::string> services) {
  grpc::health::v1::HealthCheckRequest::descriptor();
  attnserve::v1::ServerConfig::descriptor();
  services.push_back(rv1::ServerReflection::service_full_name());
  services.push_back(rv1alpha::ServerReflection::service_full_name());
  return services;
}

}  // namespace

Reflection::Reflection(std::vector<std::string> services)
    : services_(WithReflection(std::move(services))),
      v1_(std::make_unique<V1>(&services_)),
      v1alpha_(std::make_unique<V1Alpha>(&services_)) {}

Reflection::~Reflection() = default;

}  // namespace attn
